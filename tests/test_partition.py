"""Pad/split math and the padded copy helpers, against torch.nn.functional.pad as a reference."""

import pytest
import torch

from hf_lowzero.zero.partition import ParamShard, padded_numel


@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 7])
@pytest.mark.parametrize("numel", [1, 2, 5, 12, 17 * 257, 4096])
def test_rows_cover_every_element_exactly_once(numel, world_size):
    shard = ParamShard(numel, world_size)
    assert shard.padded_numel == padded_numel(numel, world_size)
    assert shard.padded_numel % world_size == 0
    assert 0 <= shard.padding < world_size
    covered = []
    for rank in range(world_size):
        start, end = shard.owned_range(rank)
        covered.extend(range(start, end))
        assert shard.owned_numel(rank) == end - start <= shard.shard_numel
    assert covered == list(range(numel))


@pytest.mark.parametrize("numel,world_size", [(17 * 257, 3), (10, 4), (8, 4), (1, 3), (7, 1)])
def test_scatter_matches_padded_view_and_gather_inverts_it(numel, world_size):
    shard = ParamShard(numel, world_size)
    flat = torch.randn(numel)
    expected = torch.nn.functional.pad(flat, (0, shard.padding)).view(world_size, shard.shard_numel)
    # A strided destination: this param's columns inside a wider rank-major bucket.
    bucket = torch.full((world_size, shard.shard_numel + 5), float("nan"))
    rows = bucket[:, 2 : 2 + shard.shard_numel]
    shard.scatter_into(rows, flat)
    assert torch.equal(rows, expected)
    assert bucket[:, :2].isnan().all() and bucket[:, 2 + shard.shard_numel :].isnan().all()

    out = torch.empty(numel)
    shard.gather_from(rows, out)
    assert torch.equal(out, flat)

    shard.scatter_into(rows, None)
    assert torch.equal(rows, torch.zeros_like(rows))


def test_invalid_sizes_are_refused():
    with pytest.raises(ValueError, match="positive"):
        ParamShard(0, 2)
