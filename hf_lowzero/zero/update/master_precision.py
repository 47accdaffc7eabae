"""The precision of the master rows: what the inner optimizer steps, and how its fp32 result gets
back into masters kept in bf16.

Example::

    precision = make_master_precision(master.flat, slots, "stochastic", seed=0, shard=shard)
    precision.inner_params                # per slot: the fp32 tensor the inner optimizer steps, or None
    with precision.stepping():            # bf16: fp32 scratch allocated, filled, rounded back, freed
        inner_optimizer.step()

# [Note: bf16 masters]
# With ``ZeroConfig.master_dtype="bf16"`` a rank keeps its owned master rows in bf16 between steps:
# 2 bytes per owned element instead of 4. The inner optimizer still computes in fp32: its inner
# params ([Note: inner params] in ``inner/adopt.py``) are fp32 views of one scratch tensor in the
# owned space whose storage exists only during the step (FSDP2's trick:
# ``untyped_storage().resize_(nbytes)`` before, ``resize_(0)`` after; the views, and so the inner
# params and the state keys, stay the same tensors). A step
# upcasts the bf16 masters into the scratch, runs the inner step (its state is created
# ``zeros_like`` the fp32 views, so it stays fp32), rounds the scratch back into the masters and
# frees it. The step's transient peak holds one fp32 copy of the owned rows, at a point where
# activations are freed, so the training peak (backward) drops by 2 bytes per owned element.
# Gradient rows stay fp32. With offload the scratch lives on the host, with the rows.
# Rounding: "nearest" is torch's round-to-nearest-even (an update smaller than half a bf16 ulp of
# the weight is lost: small learning rates stall); "stochastic" rounds up with probability equal
# to the distance from the lower neighbour, so E[round(x)] = x and small updates survive on
# average. Its noise comes from a generator per optimizer, on the rows' device, seeded from
# ``master_rounding_seed`` and the rank. The generator's state is not checkpointed: a resumed run
# reseeds it, so it draws other noise than the uninterrupted run would have (the same
# distribution, so training is unaffected on average, but not bit-identical across a resume).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from hf_lowzero.zero.layout.packing import inner_view, piece_view
from hf_lowzero.zero.layout.params import ParamSlot
from hf_lowzero.zero.runtime.shard_group import ShardGroup

STEP_DTYPE = torch.float32  # what the inner optimizer computes in, whatever the masters' dtype
ROUNDING_CHUNK = 1 << 20  # elements rounded at once: bounds the int32 noise buffer of a step
_HIGH_16_BITS = -(1 << 16)  # 0xFFFF0000 as an int32


def round_nearest(src: torch.Tensor, out: torch.Tensor) -> None:
    """``out`` (bf16) = ``src`` (fp32) rounded to nearest, ties to even: ``src.to(torch.bfloat16)``."""
    out.copy_(src)


def round_stochastic(src: torch.Tensor, out: torch.Tensor, generator: torch.Generator | None = None) -> None:
    """``out`` (bf16) = ``src`` (fp32) rounded stochastically: to one of its two bf16 neighbours,
    the upper one (in magnitude) with probability equal to the distance from the lower one in bf16
    ulps, so ``E[out] = src``.

    Uniform random bits are added to the 16 low bits of the fp32 bit pattern (which carry into the
    bf16 part exactly when the noise exceeds the distance to the next bf16 value), the low bits
    are cleared, and the result, now exactly representable, is converted. Works in chunks of
    ``ROUNDING_CHUNK`` elements (one int32 buffer of that size).

    Example::

        >>> x = torch.full((100_000,), 1.0 + 2**-9)     # a quarter of the way from 1 to 1 + 2**-7
        >>> y = torch.empty_like(x, dtype=torch.bfloat16)
        >>> round_stochastic(x, y, torch.Generator().manual_seed(0))
        >>> y.float().mean()                            # about 1.001953 = x
    """
    bits, flat_out = src.reshape(-1).view(torch.int32), out.reshape(-1)
    for start in range(0, bits.numel(), ROUNDING_CHUNK):
        chunk = bits[start : start + ROUNDING_CHUNK]
        noisy = torch.randint(0, 1 << 16, chunk.shape, dtype=torch.int32, device=chunk.device, generator=generator)
        noisy.add_(chunk).bitwise_and_(_HIGH_16_BITS)
        flat_out[start : start + ROUNDING_CHUNK].copy_(noisy.view(torch.float32))


class FullPrecisionMasters:
    """fp32 masters: the inner params are views of the master rows themselves."""

    def __init__(self, flat: torch.Tensor, slots: list[ParamSlot]) -> None:
        self.inner_params = [inner_view(s, piece_view(flat, s)) for s in slots]

    @contextlib.contextmanager
    def stepping(self) -> Iterator[None]:
        yield

    def scratch_bytes(self) -> int:
        return 0


class Bf16Masters:
    """bf16 masters stepped through an fp32 scratch that exists only during the step
    ([Note: bf16 masters])."""

    def __init__(
        self, flat: torch.Tensor, slots: list[ParamSlot], rounding: str, seed: int, *, shard: ShardGroup
    ) -> None:
        self.masters = flat  # 1D bf16, the owned space
        self.scratch = torch.empty(flat.shape, dtype=STEP_DTYPE, device=flat.device)  # 1D fp32, same layout
        self._nbytes = self.scratch.untyped_storage().nbytes()
        # the inner params: views made while the storage has its size
        self.inner_params = [inner_view(s, piece_view(self.scratch, s)) for s in slots]
        self.scratch.untyped_storage().resize_(0)
        self.rounding = rounding
        self.generator = None
        if rounding == "stochastic":
            self.generator = torch.Generator(device=flat.device)
            self.generator.manual_seed(seed * 1_000_003 + shard.rank)

    @contextlib.contextmanager
    def stepping(self) -> Iterator[None]:
        """Allocate and fill the scratch, let the inner optimizer step it, round it back into the
        masters and free it (also when the step raised: the masters then keep their old values)."""
        storage = self.scratch.untyped_storage()
        storage.resize_(self._nbytes)
        try:
            self.scratch.copy_(self.masters)
            yield
            if self.rounding == "stochastic":
                round_stochastic(self.scratch, self.masters, self.generator)
            else:
                round_nearest(self.scratch, self.masters)
        finally:
            storage.resize_(0)

    def scratch_bytes(self) -> int:
        """Bytes the scratch holds right now (0 outside a step)."""
        return self.scratch.untyped_storage().nbytes()


def make_master_precision(
    flat: torch.Tensor, slots: list[ParamSlot], rounding: str, seed: int, *, shard: ShardGroup
) -> FullPrecisionMasters | Bf16Masters:
    """The precision policy for master rows ``flat`` (its dtype decides; ``ZeroConfig`` validated
    ``rounding``, which only bf16 masters use)."""
    if flat.dtype == STEP_DTYPE:
        return FullPrecisionMasters(flat, slots)
    return Bf16Masters(flat, slots, rounding, seed, shard=shard)
