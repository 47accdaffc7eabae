"""Pad/split math of one parameter."""

import pytest

from hf_lowzero.zero.layout.partition import ParamShard, padded_numel


@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 7])
@pytest.mark.parametrize("numel", [1, 2, 5, 12, 17 * 257, 4096])
def test_rows_cover_every_element_exactly_once(numel, world_size):
    shard = ParamShard(numel, world_size=world_size)
    assert shard.padded_numel == padded_numel(numel, world_size=world_size)
    assert shard.padded_numel % world_size == 0
    assert 0 <= shard.padding < world_size
    covered = []
    for rank in range(world_size):
        start, end = shard.owned_range(rank)
        covered.extend(range(start, end))
        assert shard.owned_numel(rank) == end - start <= shard.shard_numel
    assert covered == list(range(numel))


def test_invalid_sizes_are_refused():
    with pytest.raises(ValueError, match="positive"):
        ParamShard(0, world_size=2)
