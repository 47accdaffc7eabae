"""How the plan spends its simulations (issue 56): the largest batch found in a few steps, not one
simulation per sample, and a large model's steps split over two processes with the same plan.

The search is checked against stepping down one sample at a time on peaks shaped as a step's are
(the largest of lines in the batch); the split against the plan in one process.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import pytest

from hf_lowzero import LowZeroTrainingArguments, plan_memory
from hf_lowzero.plan.measure import tiny_model_spec
from hf_lowzero.plan.planner import _largest_batch
from hf_lowzero.plan.simulations import PROCESSES_ENV, plan_processes
from hf_lowzero.plan.step_records import Setup
from hf_lowzero.simulation.launch import FakeCudaUnavailable, fake_cuda_library

GB = 10**9


@dataclass
class Peak:
    peak: int


class PeakOfLines:
    """A step's peak as a function of the batch: the largest of its moments, each linear in the batch."""

    def __init__(self, lines: list[tuple[int, int]]) -> None:
        self.lines, self.batches = lines, []

    def __call__(self, setup: Setup, batch_size: int, rank: int = 0) -> Peak:
        self.batches.append(batch_size)
        return Peak(max(a + b * batch_size for a, b in self.lines))


def stepping_down(peak_of, first_guess: int, usable: int) -> int:
    """The largest batch at or below ``first_guess`` that fits, one sample at a time (the old check)."""
    batch = first_guess
    while batch > 0 and peak_of(Setup(2), batch).peak > usable:
        batch -= 1
    return batch


# (lines, usable): Llama-3-8B at W=16 with checkpointing (the update's peak first, then the activations'),
# one line, three pieces, and a usable size right at a piece's end
SHAPES = [
    ([(41 * GB, 0), (20 * GB, 3_760_000_000)], 77 * GB),
    ([(5 * GB, 700_000_000)], 60 * GB),
    ([(30 * GB, 10), (12 * GB, 2 * GB), (-40 * GB, 5 * GB)], 70 * GB),
    ([(30 * GB, 0), (10 * GB, 2 * GB)], 50 * GB),
]


@pytest.mark.parametrize("lines, usable", SHAPES)
def test_the_largest_batch_is_stepping_downs_in_a_few_simulations(lines, usable):
    peak_of = PeakOfLines(lines)
    first_guess = 735_558  # what the line through batches 1 and 2 gave Llama-3-8B with checkpointing
    expected = stepping_down(PeakOfLines(lines), first_guess, usable)
    fits, over = (1, peak_of(Setup(2), 1).peak), (first_guess, peak_of(Setup(2), first_guess).peak)
    assert fits[1] <= usable < over[1]
    peak_of.batches.clear()
    assert _largest_batch(peak_of, Setup(2), fits, over, usable) == expected
    assert len(peak_of.batches) <= 5  # stepping down took 735,558 - expected simulations
    assert peak_of(Setup(2), expected).peak <= usable < peak_of(Setup(2), expected + 1).peak


def test_the_number_of_processes_is_one_or_two_and_a_wrong_setting_says_so(monkeypatch):
    monkeypatch.setenv(PROCESSES_ENV, "2")
    assert plan_processes(1000) == 2
    monkeypatch.setenv(PROCESSES_ENV, "1")
    assert plan_processes(10**11) == 1
    monkeypatch.delenv(PROCESSES_ENV)
    assert plan_processes(1000) == 1  # a small model: a second process would cost more than it saves
    monkeypatch.setenv(PROCESSES_ENV, "4")
    with pytest.raises(ValueError, match="HF_LOWZERO_PLAN_PROCESSES='4' is invalid; expected 1 .* or 2"):
        plan_processes(10**11)


@pytest.mark.slow  # two plans of a GPT-2 in fake-GPU processes: 14 s
def test_two_processes_give_the_plan_of_one(monkeypatch):
    """Every figure of every row, the recommendation and its checked batch: the same in one process or two."""
    try:
        fake_cuda_library()
    except FakeCudaUnavailable as e:
        pytest.skip(str(e))
    args = LowZeroTrainingArguments(
        output_dir=os.devnull, use_cpu=True, report_to=[], bf16=True, per_device_train_batch_size=1
    )
    plans = {}
    for processes in ("1", "2"):
        monkeypatch.setenv(PROCESSES_ENV, processes)
        plan = plan_memory(
            tiny_model_spec("gpt2"), args, world_size=4, device_memory="12MiB", seq_len=64, backend="gloo"
        )
        plans[processes] = plan.to_dict()
    assert plans["1"]["recommended"]["max_batch_size"] > 1  # the check of the largest batch ran
    assert plans["2"] == plans["1"]
