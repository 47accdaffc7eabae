"""The test ranks' rendezvous ([Note: the rendezvous held by the caller] in ``hf_lowzero/testing.py``):
its port is bound from before the ranks start until they are done, so no other process can take it
in between, and the ranks meet there."""

import socket

import pytest
import torch
import torch.distributed as dist

from hf_lowzero.testing import rendezvous, run_distributed


def test_the_port_is_taken_while_the_rendezvous_is_held():
    with rendezvous(2) as port, socket.socket() as other, pytest.raises(OSError, match="in use"):
        other.bind(("127.0.0.1", port))
    with socket.socket() as other:
        other.bind(("127.0.0.1", port))  # and given back after


def _sum_of_ranks(rank: int, world_size: int) -> None:
    total = torch.tensor([float(rank)])
    dist.all_reduce(total)
    assert total.item() == sum(range(world_size))


def test_ranks_meet_at_the_callers_store():
    run_distributed(_sum_of_ranks, 3)
