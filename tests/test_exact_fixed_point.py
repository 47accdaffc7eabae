"""Exact reduction's C++ kernels (``hf_lowzero/zero/exact/fixed_point.cpp``) give the torch path's bits:
the int64 buffers, the maxima, the converted rows and the squares; and a whole run at W=2 with the C++
kernels ends with the parameters of one on the torch path."""

from __future__ import annotations

import os

import pytest
import torch

from hf_lowzero.testing import run_distributed
from hf_lowzero.zero.exact import fixed_point
from hf_lowzero.zero.exact.grid import square_exponents
from hf_lowzero.zero.exact.segments import Segments
from hf_lowzero.zero.runtime import native
from tests.test_exact_reduction import assert_identical, train

SLOTS = [3, 0, 5, 1, 4, 2]
LENGTHS = [7, 1, 0, 40001, 333, 16]  # odd lengths, an empty one, one longer than a kernel's piece (2**14)


@pytest.fixture(autouse=True)
def kernels():
    """Skip where the C++ kernels cannot be built (no compiler), saying why."""
    if fixed_point.native_kernels() is None:
        pytest.skip(f"exact kernels unavailable: {native.load(fixed_point.SOURCE)}")


def awkward_floats(n: int, g: torch.Generator) -> torch.Tensor:
    """Normal values at scales from 2**-140 to 2**100 (subnormal to huge), with zeros of both signs,
    NaN and infinities sprinkled in."""
    values = torch.randn(n, generator=g) * 2.0 ** torch.randint(-140, 100, (n,), generator=g).float()
    specials = torch.tensor([0.0, -0.0, float("nan"), float("inf"), -float("inf"), 1e-45, -3.4e38])
    where = torch.randint(0, n, (n // 50 + 1,), generator=g)
    values[where] = specials[torch.randint(0, len(specials), where.shape, generator=g)]
    return values


@pytest.mark.parametrize("rows", [1, 3])
@pytest.mark.parametrize("threads", [1, 3])
@pytest.mark.parametrize("add", [False, True])
def test_quantize_gives_the_torch_path_bits(rows, threads, add):
    g = torch.Generator().manual_seed(rows * 10 + threads + add)
    packed = Segments.of(rows, SLOTS, LENGTHS)
    values = awkward_floats(rows * packed.cols, g)
    factors = [2.0 ** int(s) for s in torch.randint(-120, 121, (len(packed.slots),), generator=g)]
    factors[2] = 2.0**40  # the long param: many in-range integers
    start = torch.randint(-(2**62), 2**62, (rows * packed.cols,), generator=g)
    old_max = torch.rand(len(SLOTS), generator=g) * 2.0**60  # some maxima already larger
    results = []
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for use_native in (True, False):
            out, max_abs = start.clone(), old_max.clone()
            fixed_point.quantize(packed, values.clone(), factors, max_abs, out, add=add, use_native=use_native)
            results.append((out, max_abs))
    finally:
        torch.set_num_threads(previous)
    (out, max_abs), (expected_out, expected_max) = results
    assert torch.equal(max_abs, expected_max)
    assert max_abs.isinf().sum() >= 2 and (max_abs != old_max).any()  # NaN and inf seen; maxima taken
    # Where a product leaves int64's range (or is NaN) the conversion is the platform's (x86: INT64_MIN)
    # and never read: that param's maximum overflows the grid and the step is skipped.
    scaled = torch.cat([v * f for v, f in zip(packed.views(values), factors)], dim=-1).reshape(-1)
    columns = torch.cat([v for v in packed.views(torch.arange(rows * packed.cols))], dim=-1).reshape(-1)
    in_range = columns[scaled.abs() < 2.0**63]
    assert len(in_range) > rows * packed.cols // 4, "too few in-range values: the test checks little"
    assert torch.equal(out[in_range], expected_out[in_range])
    assert ((out[in_range] != start[in_range]) & (expected_out[in_range] != 0)).sum() > 1000


@pytest.mark.parametrize("threads", [1, 3])
def test_int_max_abs_and_convert_give_the_torch_path_bits(threads):
    g = torch.Generator().manual_seed(threads)
    owned = Segments.of(1, SLOTS, LENGTHS)
    sums = torch.randint(-(2**62), 2**62, (owned.cols,), generator=g)
    shifts = torch.randint(0, 62, (owned.cols,), generator=g)
    sums = sums >> shifts  # magnitudes from 1 to 2**62
    sums[::97] = 0
    sums[owned.starts[1]] = 0  # an all-zero param
    numels = [n + 5 for _, n in sorted(zip(SLOTS, LENGTHS))]  # by slot: whole params, longer than these pieces
    factors = [
        2.0 ** -int(s) / d for s, d in zip(torch.randint(-60, 120, (len(SLOTS),), generator=g), [3, 1, 7, 6, 1, 5])
    ]
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    results = []
    try:
        for use_native in (True, False):
            maxima = torch.full((len(SLOTS),), -1.0, dtype=torch.float64)
            fixed_point.int_max_abs(owned, sums, maxima, use_native=use_native)
            square_exps = square_exponents([m * f for m, f in zip(maxima.tolist(), factors)], numels)
            rows, squares = torch.full((owned.cols,), -1.0), torch.full((len(SLOTS),), -1.0, dtype=torch.float64)
            listed = [factors[i] for i in owned.slots], [2.0 ** square_exps[i] for i in owned.slots]
            fixed_point.convert(owned, sums, *listed, rows, squares, use_native=use_native)
            results.append((maxima, rows, squares))
    finally:
        torch.set_num_threads(previous)
    for got, expected, what in zip(results[0], results[1], ["maxima", "rows", "squares"]):
        assert torch.equal(got, expected), what
    maxima, rows, squares = results[0]
    assert maxima[SLOTS[2]] == -1.0 and squares[SLOTS[2]] == -1.0  # the empty param is not listed
    assert maxima[SLOTS[1]] == 0.0 and (squares[list(owned.slots)] > 2.0**30).sum() >= 4  # big integer sums, exact


def test_int_max_abs_of_the_most_negative_int64():
    """torch negates the minimum with wraparound (INT64_MIN stays INT64_MIN): the kernel does too."""
    owned = Segments.of(1, [0, 1], [3, 2])
    sums = torch.tensor([-(2**63), 5, -7, -(2**63), -(2**63)])
    maxima = [torch.zeros(2, dtype=torch.float64) for _ in range(2)]
    for use_native, out in zip((True, False), maxima):
        fixed_point.int_max_abs(owned, sums, out, use_native=use_native)
    assert torch.equal(maxima[0], maxima[1])


CASES = ["stage 2 fp32 clip", "stage 1 fp16 loss scaling clip", "stage 2 wide one bucket, verified"]


def both_paths(rank: int, world_size: int, out: str, torch_path: bool) -> None:
    if torch_path:
        os.environ[native.SWITCH_ENV] = "0"  # this rank's first kernel load sees it
    results = {name: train(rank, world_size, name) for name in CASES}
    assert (fixed_point.native_kernels() is None) == torch_path
    if rank == 0:
        torch.save(results, out)


@pytest.mark.parametrize("world_size", [1, 2])
def test_a_run_with_the_kernels_ends_with_the_torch_path_bits(world_size, tmp_path):
    results = []
    for torch_path in (False, True):
        out = str(tmp_path / f"{torch_path}.pt")
        run_distributed(both_paths, world_size, out=out, torch_path=torch_path)
        results.append(torch.load(out))
    for name in CASES:
        assert any(results[1][name]["applied"]), f"{name}: no step applied, the case tests nothing"
        assert_identical(results[0][name], results[1][name], f"{name} at W={world_size}")


def test_fake_tensors_take_the_torch_path():
    """A memory plan runs the step on fake tensors (no data): the kernels must not read them."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        packed = Segments.of(2, [0, 1], [3, 4])
        values, out, max_abs = torch.ones(14), torch.zeros(14, dtype=torch.int64), torch.zeros(2)
        assert fixed_point.native_kernels((values, torch.float32)) is None
        fixed_point.quantize(packed, values, [1.0, 2.0], max_abs, out, add=False)
    assert out.shape == (14,)
