"""The pool of communication scratch buffers (pure, single process)."""

import torch

from hf_lowzero.zero.runtime.buffers import BufferPool

CPU = torch.device("cpu")


def test_buffers_are_reused_and_the_smallest_fitting_one_is_handed_out():
    pool = BufferPool()
    big, small = pool.take(100, torch.float32, CPU), pool.take(40, torch.float32, CPU)
    assert (big.numel(), small.numel()) == (100, 40)
    pool.give(big)
    pool.give(small)
    again = pool.take(30, torch.float32, CPU)
    assert again.numel() == 30 and again.data_ptr() == small.data_ptr()
    assert len(pool.tensors()) == 2


def test_mixed_sizes_never_hold_more_buffers_than_are_taken_at_once():
    pool = BufferPool()
    for numels in [(100, 100), (101, 101), (100, 100), (101, 99), (50, 101)]:  # two in use at a time
        taken = [pool.take(n, torch.float32, CPU) for n in numels]
        assert [t.numel() for t in taken] == list(numels)
        assert len({t.data_ptr() for t in taken}) == 2, "buffers in use at once never share storage"
        for t in taken:
            pool.give(t)
    assert sorted(t.numel() for t in pool.tensors()) == [101, 101]


def test_dtypes_are_pooled_apart():
    pool = BufferPool()
    pool.give(pool.take(10, torch.float32, CPU))
    half = pool.take(10, torch.bfloat16, CPU)
    assert half.dtype == torch.bfloat16 and len(pool.tensors()) == 2
