"""The shared scheduler of "auto" intervals (hf_lowzero/zero/auto_interval.py): the interval it
proposes against the budget's formula, the ranks' agreement, the steps it makes due, the settings it
accepts; and the two budgets that use it, snapshots' and integrity checks'."""

import math

import pytest

from hf_lowzero.ray.snapshot_plan import SNAPSHOTS, check_every
from hf_lowzero.zero.auto_interval import AUTO, AutoInterval, Budget, Median, Smoothed
from hf_lowzero.zero.zero_config import VERIFY, check_verify_every


def _budget(**changes) -> Budget:
    fields = dict(
        setting="every",
        work="the work",
        overhead=0.05,
        max_interval=30,
        off=("off",),
        off_text="'off'",
        step_time=Median,
        cost=Median,
    )
    return Budget(**(fields | changes))


@pytest.mark.parametrize(
    ("cost_s", "step_s"),
    [(0.012, 0.1), (0.0049, 0.1), (0.05, 0.1), (0.0, 0.2), (3.0, 0.1), (0.0051, 0.1)],
)
def test_auto_proposes_the_fewest_steps_that_keep_the_cost_within_the_budget(cost_s, step_s):
    budget = _budget()
    schedule = AutoInterval("auto", budget)
    assert schedule.proposed_interval() == 1  # nothing measured: the interval it has
    schedule.add_step(step_s)
    assert schedule.proposed_interval() == 1  # no cost yet
    schedule.add_cost(cost_s)
    # c / (n s) <= f  <=>  n >= c / (f s): the least such n, within [1, max_interval]
    expected = max(1, min(budget.max_interval, math.ceil(cost_s / (budget.overhead * step_s))))
    assert schedule.proposed_interval() == expected
    schedule.taken(10, expected)
    assert schedule.overhead() == pytest.approx(cost_s / (expected * step_s))
    if 1 < expected < budget.max_interval:  # not clamped: within the budget, and one step fewer is not
        assert schedule.overhead() <= budget.overhead < cost_s / ((expected - 1) * step_s)


def test_the_hand_computed_intervals():
    schedule = AutoInterval("auto", _budget())
    schedule.add_step(0.1)
    for cost_s, interval in ((0.012, 3), (0.0049, 1), (0.05, 10), (0.0, 1), (3.0, 30), (0.0051, 2)):
        schedule.add_cost(cost_s)  # Median(1): the latest cost alone
        assert schedule.proposed_interval() == interval


def test_the_budgets_summaries_decide_what_cost_and_step_time_are():
    schedule = AutoInterval("auto", _budget(step_time=lambda: Median(3), cost=lambda: Smoothed(0.25)))
    for seconds in (0.5, 0.1, 0.12, 0.11):  # the window keeps the last three: 0.1, 0.12, 0.11
        schedule.add_step(seconds)
    assert schedule.step_s == pytest.approx(0.11)
    schedule.add_cost(0.02)
    assert schedule.cost_s == pytest.approx(0.02)  # the first counts whole
    schedule.add_cost(0.06)
    assert schedule.cost_s == pytest.approx(0.75 * 0.02 + 0.25 * 0.06)
    assert schedule.proposed_interval() == math.ceil((0.75 * 0.02 + 0.25 * 0.06) / (0.05 * 0.11)) == 6
    assert AutoInterval("auto", _budget()).step_s is None and AutoInterval("auto", _budget()).cost_s is None


def test_a_zero_step_time_keeps_the_interval():
    schedule = AutoInterval("auto", _budget())
    schedule.taken(4, 7)
    schedule.add_step(0.0)
    schedule.add_cost(0.01)
    assert schedule.proposed_interval() == 7 and schedule.overhead() is None


def test_ranks_agree_on_the_largest_proposal_within_the_cap():
    schedule = AutoInterval("auto", _budget(max_interval=20))
    assert schedule.agreed([3, 9.0, 4]) == 9
    assert schedule.agreed([0, 0]) == 1
    assert schedule.agreed([5, 1000]) == 20
    schedule.cap = 6  # a caller may lower it (snapshots: half the storage checkpoints' interval)
    assert schedule.agreed([5, 9]) == 6
    # clamping each proposal first gives the same: the clamp is monotone
    proposals = [0, 2, 7, 31]
    assert schedule.agreed(proposals) == schedule.agreed([min(6, max(1, p)) for p in proposals])


def test_a_fixed_interval_is_kept_whatever_the_costs():
    schedule = AutoInterval("7", _budget(max_interval=3))
    assert (schedule.every, schedule.auto, schedule.interval) == (7, False, 7)
    schedule.add_step(0.1)
    schedule.add_cost(100.0)
    assert schedule.proposed_interval() == 7


def test_due_counts_from_the_step_last_taken():
    schedule = AutoInterval(AUTO, _budget())
    assert [s for s in range(1, 4) if schedule.due(s)] == [1, 2, 3]  # due from step 1
    schedule.taken(3, 4)
    assert (schedule.interval, schedule.next_step) == (4, 7)
    assert [s for s in range(4, 10) if schedule.due(s)] == [7, 8, 9]


def test_settings_are_checked_for_each_budget():
    budget = _budget(off=(None, "off", "none"), off_text="None (never)")
    accepted = {3: 3, "12": 12, " 5 ": 5, "auto": "auto", "AUTO": "auto", " Off": None, "none": None, None: None}
    assert {value: budget.check(value) for value in accepted} == accepted
    for bad in (0, -1, "0", "often", 2.5, True, [3]):
        with pytest.raises(ValueError, match=r"^every=.* is invalid; expected a number of steps >= 1") as raised:
            budget.check(bad)
        assert "'auto' (the interval that keeps the work within 5% of training time) or None (never)" in str(
            raised.value
        )
    with pytest.raises(ValueError, match=r"every=None is invalid.* or 'off'$"):
        _budget().check(None)  # None is off only where the budget says so
    assert AutoInterval("off", _budget()).every is None


def test_a_budget_is_checked():
    with pytest.raises(ValueError, match=r"Budget.overhead=0 is invalid"):
        _budget(overhead=0)
    with pytest.raises(ValueError, match=r"Budget.overhead=1.5 is invalid"):
        _budget(overhead=1.5)
    with pytest.raises(ValueError, match=r"Budget.max_interval=0 is invalid"):
        _budget(max_interval=0)


def test_snapshots_and_checks_share_the_code_with_their_own_budgets():
    assert (SNAPSHOTS.overhead, SNAPSHOTS.max_interval) == (0.02, 10_000)
    assert (VERIFY.overhead, VERIFY.max_interval) == (0.01, 1000)
    for budget in (SNAPSHOTS, VERIFY):
        schedule = AutoInterval("auto", budget)
        schedule.add_step(0.1)
        schedule.add_cost(0.0123)
        assert schedule.proposed_interval() == math.ceil(0.0123 / (budget.overhead * 0.1))
    assert check_every("off") is None and check_every(None) is None and check_every("4") == 4
    assert check_verify_every("OFF") == "off" and check_verify_every(" auto ") == "auto" and check_verify_every(9) == 9
    with pytest.raises(ValueError, match=r"snapshot_every=0 is invalid.*within 2% .* or None \(no memory snapshots\)"):
        check_every(0)
    with pytest.raises(ValueError, match=r"verify_every=None is invalid.*the checks within 1% .* or 'off'"):
        check_verify_every(None)


def test_verify_budget_smooths_step_times_and_takes_each_steps_own_cost():
    schedule = AutoInterval("auto", VERIFY)
    for seconds in (0.2, 0.1, 0.1):
        schedule.add_step(seconds)
    assert schedule.step_s == pytest.approx(0.8 * (0.8 * 0.2 + 0.2 * 0.1) + 0.2 * 0.1)
    schedule.add_cost(0.5)
    schedule.add_cost(0.003)
    assert schedule.cost_s == 0.003
