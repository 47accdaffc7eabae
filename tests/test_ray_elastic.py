"""Elastic Ray Train's flags: ``num_workers`` as a count or a range, the global batch kept through
resizes by gradient accumulation, and what is refused by name.

The elastic runs themselves (a node lost and back, each attempt resuming resharded, every step's loss
that of a fixed-size run) are ``tests/test_exact_ray.py``'s, bit for bit, and
``tests/test_recovery.py``'s, from memory.
"""

import pytest

ray = pytest.importorskip("ray")

from hf_lowzero.ray.elastic import accumulation_for_global_batch, parse_num_workers  # noqa: E402
from hf_lowzero.recipes.clm_ray import RayFinetuneConfig  # noqa: E402


@pytest.mark.parametrize(
    ("given", "expected"),
    [("3", 3), ("1-4", (1, 4)), (" 2 - 8 ", (2, 8)), ((1, 2), (1, 2)), ([2, 3], (2, 3)), ("2-2", 2)],
)
def test_num_workers_takes_a_count_or_a_range(given, expected):
    assert parse_num_workers(given) == expected
    assert RayFinetuneConfig(num_workers=given).num_workers == expected


@pytest.mark.parametrize(
    ("given", "message"),
    [("0", "expected at least 1"), ("3-1", "1 <= MIN <= MAX"), ("0-2", "1 <= MIN <= MAX"), ("two", "MIN-MAX"),
     ((1, 2, 3), "MIN-MAX"), (True, "MIN-MAX")],
)  # fmt: skip
def test_num_workers_rejects_what_is_not_a_count_or_a_range(given, message):
    with pytest.raises(ValueError, match=message):
        RayFinetuneConfig(num_workers=given)


def test_global_batch_size_sets_accumulation_per_world_size():
    config = RayFinetuneConfig(num_workers="1-4", per_device_train_batch_size=2, global_batch_size=24)
    assert [config.gradient_accumulation_for(w) for w in (1, 2, 3, 4)] == [12, 6, 4, 3]
    assert [2 * config.gradient_accumulation_for(w) * w for w in (1, 2, 3, 4)] == [24] * 4
    assert RayFinetuneConfig(num_workers=2, gradient_accumulation_steps=3).gradient_accumulation_for(1) == 3
    with pytest.raises(ValueError, match="not a positive multiple of .* 2 \\* 3 = 6"):
        accumulation_for_global_batch(8, per_device=2, world_size=3)
    with pytest.raises(ValueError, match="per_device_train_batch_size \\* world size = 4 \\* 3 = 12"):
        RayFinetuneConfig(num_workers="2-3", global_batch_size=16)  # fine at 2 workers, not at 3
    with pytest.raises(ValueError, match="give one"):
        RayFinetuneConfig(global_batch_size=16, gradient_accumulation_steps=2)


@pytest.mark.parametrize(
    ("field", "value"),
    [("resources_per_worker", "{CPU: 1}"), ("resources_per_worker", '["CPU"]'), ("resources_per_worker", '{"CPU": -1}'),
     ("checkpoint_upload", "later"), ("resize_check_interval_s", -1.0)],
)  # fmt: skip
def test_bad_ray_flags_are_rejected_by_name(field, value):
    with pytest.raises(ValueError, match=field):
        RayFinetuneConfig(**{field: value})
