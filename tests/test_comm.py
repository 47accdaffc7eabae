"""The collectives module against torch's own collectives: on gloo, reduce-scatter and all-gather
of at least POINT_TO_POINT_MIN_BYTES are point-to-point exchanges ([Note: gloo point-to-point]; the
test lowers the limit to 0); several in flight at once, of different
sizes, on the whole world and on subgroups, give exactly what the collectives give (the sum in
rank order), and count the bytes of the collective they replace."""

import pytest
import torch
import torch.distributed as dist

from hf_lowzero.testing import run_distributed
from hf_lowzero.zero.runtime import comm
from hf_lowzero.zero.runtime.comm import comm_stats

SIZES = (1, 37, 1000)  # per-rank chunk numels of the exchanges in flight at once


def rank_order_sum(chunks: list[torch.Tensor]) -> torch.Tensor:
    total = chunks[0].clone()
    for chunk in chunks[1:]:
        total.add_(chunk)
    return total


def check_group(group, seed: int) -> None:
    world, rank = comm.group_size(group), comm.group_rank(group)
    g = torch.Generator().manual_seed(seed + rank)
    inputs = [torch.randn(world * n, generator=g) for n in SIZES]
    rows = [torch.randn(n, generator=g) for n in SIZES]
    reduced = [torch.full((n,), float("nan")) for n in SIZES]
    gathered = [torch.full((world * n,), float("nan")) for n in SIZES]
    workspace = torch.full((world * SIZES[-1],), float("nan"))

    comm_stats.reset()
    works = []  # everything in flight before anything is waited for
    for i, (flat, out) in enumerate(zip(inputs, reduced)):
        last = i == len(SIZES) - 1  # the last one sums into its workspace's first chunk
        target = workspace[: SIZES[-1]] if last else out
        works.append(comm.reduce_scatter(target, flat, group, async_op=True, workspace=workspace if last else None))
    works += [comm.all_gather(out, row, group, async_op=True) for out, row in zip(gathered, rows)]
    for work in works:
        comm.wait(work)
    reduced[-1] = workspace[: SIZES[-1]]

    for flat, out in zip(inputs, reduced):
        every = torch.empty(world * flat.numel())
        dist.all_gather_into_tensor(every, flat, group=group)  # every rank's whole input
        chunks = [every.view(world, world, -1)[r, rank] for r in range(world)]
        assert torch.equal(out, rank_order_sum(chunks))
        native = torch.empty_like(out)
        dist.reduce_scatter_tensor(native, flat.clone(), group=group)
        torch.testing.assert_close(out, native, rtol=1e-6, atol=1e-6)  # gloo's own sums in another order
    for row, out in zip(rows, gathered):
        native = torch.empty_like(out)
        dist.all_gather_into_tensor(native, row, group=group)
        assert torch.equal(out, native)

    payload = sum(x.numel() * 4 for x in inputs)
    assert comm_stats.calls["reduce_scatter"] == comm_stats.calls["all_gather"] == len(SIZES)
    assert comm_stats.sent_bytes["reduce_scatter"] == sum(x.numel() * 4 * (world - 1) // world for x in inputs)
    assert comm_stats.payload_bytes["reduce_scatter"] == payload == comm_stats.payload_bytes["all_gather"]


def comm_body(rank, world_size):
    limit = comm.POINT_TO_POINT_MIN_BYTES  # below it gloo's own collectives run
    assert comm.uses_point_to_point(None) and comm.uses_point_to_point(None, limit)
    assert not comm.uses_point_to_point(None, limit - 1)
    comm.POINT_TO_POINT_MIN_BYTES = 0  # this process only: exchanges at every size below
    check_group(None, seed=0)
    if world_size == 4:  # subgroups: peers are group ranks, sends go to their global ranks
        evens, odds = dist.new_group([0, 2]), dist.new_group([1, 3])
        check_group(evens if rank % 2 == 0 else odds, seed=10)


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_point_to_point_exchanges_equal_the_collectives(world_size):
    run_distributed(comm_body, world_size)


def test_only_nccl_at_a_power_of_two_world_size_averages_in_the_collective(single_rank_group):
    """[Note: the divide in the collective]: gloo divides the packed bucket first; asking its
    reduce-scatter to average is refused, naming what it needs."""
    assert not comm.premultiplies(None)
    with pytest.raises(ValueError, match="needs NCCL and a power-of-two world size"):
        comm.reduce_scatter(torch.zeros(2), torch.zeros(2), None, average=True)
