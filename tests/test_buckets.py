"""The static bucket plan, the rank-major layout and plan-order launching (pure, single process)."""

import pytest
import torch
from torch import nn

from hf_lowzero.zero.layout.buckets import BucketState, ParamSlot, PlanOrderLauncher, Reduction, plan_buckets
from hf_lowzero.zero.layout.packing import pack_bucket, unpack_bucket
from hf_lowzero.zero.layout.partition import ParamShard


def make_slots(shapes, world_size, dtypes=None):
    params = [nn.Parameter(torch.randn(*s, dtype=(dtypes or {}).get(i, torch.float32))) for i, s in enumerate(shapes)]
    return [ParamSlot(i, f"p{i}", p, ParamShard(p.numel(), world_size=world_size)) for i, p in enumerate(params)]


def test_plan_is_reverse_registration_order_and_respects_size():
    slots = make_slots([(10,), (7, 3), (100,), (5,), (6,)], world_size=3)
    buckets = plan_buckets(slots, bucket_bytes=4 * 30, comm_dtype=None)
    order = [s.index for b in buckets for s in b.slots]
    assert order == [4, 3, 2, 1, 0]
    for b in buckets:
        nbytes = 4 * 3 * b.row_numel
        assert nbytes <= 4 * 30 or len(b.slots) == 1  # only a single oversized param exceeds a bucket
    assert [s.index for s in buckets[1].slots] == [2]  # 100 elements: a bucket of its own
    # Owned rows are laid out bucket after bucket, param after param, with no gaps.
    offsets = [s.row_offset for b in buckets for s in b.slots]
    sizes = [s.shard.shard_numel for b in buckets for s in b.slots]
    assert offsets == [sum(sizes[:i]) for i in range(len(sizes))]
    assert [b.row_offset for b in buckets] == [b.slots[0].row_offset for b in buckets]


def test_plan_splits_buckets_by_dtype_and_counts_comm_dtype_bytes():
    slots = make_slots([(8,), (8,), (8,)], world_size=2, dtypes={1: torch.bfloat16})
    assert len(plan_buckets(slots, bucket_bytes=2**20, comm_dtype=None)) == 3
    same = make_slots([(8,), (8,)], world_size=2)
    assert len(plan_buckets(same, bucket_bytes=64, comm_dtype=None)) == 1  # 2 * 8 * 4 bytes
    assert len(plan_buckets(make_slots([(8,), (8,)], 2), bucket_bytes=64, comm_dtype=torch.float64)) == 2


def test_pack_is_rank_major_padded_and_frees_grads():
    world_size = 3
    slots = make_slots([(17, 5), (4,), (2, 2)], world_size)
    for s in slots:
        s.param.grad = torch.randn_like(s.param)
    grads = [s.param.grad.clone() for s in slots]
    (bucket,) = plan_buckets(slots, bucket_bytes=2**20, comm_dtype=None)
    flat = torch.full((world_size * bucket.row_numel,), float("nan"))
    pack_bucket(bucket, flat, world_size=world_size)

    rows = flat.view(world_size, bucket.row_numel)
    for rank in range(world_size):
        expected = torch.cat(
            [
                nn.functional.pad(grads[s.index].flatten(), (0, s.shard.padding)).view(world_size, -1)[rank]
                for s in bucket.slots
            ]
        )
        torch.testing.assert_close(rows[rank], expected / world_size)
    assert all(s.param.grad is None for s in slots)


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_unpack_inverts_pack_for_padded_and_unpadded_params(world_size):
    slots = make_slots([(17, 5), (4,), (2, 2), (8, 3), (1,)], world_size)
    values = [torch.randn_like(s.param) for s in slots]
    for s, v in zip(slots, values):
        s.param.grad = v.clone()
    (bucket,) = plan_buckets(slots, bucket_bytes=2**20, comm_dtype=None)
    flat = torch.full((world_size * bucket.row_numel,), float("nan"))
    pack_bucket(bucket, flat, world_size=world_size)
    with torch.no_grad():
        for s in slots:
            s.param.zero_()
    unpack_bucket(bucket, flat * world_size, world_size=world_size)
    for s, v in zip(slots, values):
        torch.testing.assert_close(s.param, v, rtol=1e-6, atol=1e-6)


def launched(events):
    def launch(bucket):
        events.append(("launch", bucket.index))
        return Reduction(bucket, None, torch.empty(0), ())

    return launch


def finished(events):
    return lambda reduction: events.append(("finish", reduction.bucket.index))


def test_launcher_launches_in_plan_order_whatever_the_ready_order():
    slots = make_slots([(4,)] * 6, world_size=1)
    buckets = plan_buckets(slots, bucket_bytes=4 * 8, comm_dtype=None)  # two params per bucket
    assert len(buckets) == 3
    events = []
    launcher = PlanOrderLauncher(buckets, launch=launched(events), finish=finished(events), max_in_flight=2)
    # The last bucket in the plan becomes complete first: nothing may launch yet.
    ready = {2}
    launcher.launch_ready(2, ready.__contains__)
    assert events == []
    ready.add(0)
    launcher.launch_ready(2, ready.__contains__)
    assert events == [("launch", 0)]
    launcher.launch_ready(0, lambda index: True)  # nothing past the furthest bucket reached
    assert events == [("launch", 0)]
    launcher.launch_all(overlap=True)  # bucket 1 never became ready: launched at the end, in order
    assert [e for e in events if e[0] == "launch"] == [("launch", 0), ("launch", 1), ("launch", 2)]
    assert events.index(("finish", 0)) < events.index(("launch", 2))  # at most two in flight
    assert sorted(e for e in events if e[0] == "finish") == [("finish", i) for i in range(3)]
    assert launcher.phase == [BucketState.WAITING] * 3 and not launcher.mid_backward


def test_launcher_without_overlap_waits_for_each_bucket():
    slots = make_slots([(4,)] * 3, world_size=1)
    buckets = plan_buckets(slots, bucket_bytes=16, comm_dtype=None)
    events = []
    launcher = PlanOrderLauncher(buckets, launched(events), finished(events))
    launcher.launch_all(overlap=False)
    assert events == [("launch", 0), ("finish", 0), ("launch", 1), ("finish", 1), ("launch", 2), ("finish", 2)]


def _native_or_skip():
    from hf_lowzero.zero.layout.row_scatter import SOURCE
    from hf_lowzero.zero.runtime import native

    library = native.load(SOURCE)
    if isinstance(library, native.NativeUnavailable):
        pytest.skip(f"our unpack kernel is not available here: {library.why}")


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_one_call_unpack_writes_what_torchs_copy_writes(world_size, dtype):
    """[Note: one call per unpack]: the kernel's unpack equals split_with_sizes_copy's bit for bit,
    for row shards and whole params, and moves each param's version as an in-place op does."""
    import dataclasses

    from hf_lowzero.zero.layout.packing import unpack_targets

    _native_or_skip()
    shapes = [(12 * world_size, 5), (4 * world_size,), (world_size, 2), (2 * world_size, 3, 2)]
    for whole in (False, True):
        slots = make_slots(shapes, world_size, dict.fromkeys(range(len(shapes)), dtype))
        if whole:
            owners = [i % world_size for i in range(len(slots))]
            slots = [ParamSlot(s.index, s.name, s.param, ParamShard(s.param.numel(), world_size=world_size, owner=o))
                     for s, o in zip(slots, owners)]  # fmt: skip
        (bucket,) = plan_buckets(slots, bucket_bytes=2**20, comm_dtype=None)
        plan = unpack_targets(bucket, world_size=world_size)
        assert plan.scatter is not None
        gathered = torch.randn(bucket.packed_numel).to(dtype)
        unpack_bucket(bucket, gathered, world_size=world_size, targets=dataclasses.replace(plan, scatter=None))
        expected = [s.param.detach().clone() for s in slots]
        versions = [s.param._version for s in slots]
        with torch.no_grad():
            for s in slots:
                s.param.zero_()
        unpack_bucket(bucket, gathered, world_size=world_size, targets=plan)
        for s, e, v in zip(slots, expected, versions):
            assert torch.equal(s.param, e), (whole, s.name)
            assert s.param._version > v + 1  # the zero_ and the unpack


def test_one_call_unpack_is_caught_by_autograd_like_an_in_place_copy():
    _native_or_skip()
    (slot,) = slots = make_slots([(4, 4)], 2)
    (bucket,) = plan_buckets(slots, bucket_bytes=2**20, comm_dtype=None)
    loss = (slot.param * slot.param).sum()  # saves the param for backward
    unpack_bucket(bucket, torch.randn(bucket.packed_numel), world_size=2)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


def test_torchs_copy_unpacks_padded_large_or_fake_params():
    from torch._subclasses.fake_tensor import FakeTensorMode

    from hf_lowzero.zero.layout.packing import unpack_targets
    from hf_lowzero.zero.layout.row_scatter import GRAIN

    _native_or_skip()
    padded = make_slots([(3, 5), (4,)], 2)  # 15 elements do not divide by 2
    large = make_slots([(2 * GRAIN + 4,), (2,)], 2)  # more than GRAIN elements per param on average
    for slots in (padded, large):
        (bucket,) = plan_buckets(slots, bucket_bytes=2**22, comm_dtype=None)
        assert unpack_targets(bucket, world_size=2).scatter is None
    with FakeTensorMode():
        fake = make_slots([(4, 4), (4,)], 2)
        (bucket,) = plan_buckets(fake, bucket_bytes=2**20, comm_dtype=None)
        assert unpack_targets(bucket, world_size=2).scatter is None
