"""The unscale-and-clip factor of [Note: one multiply], applied where it costs no pass of its own.

Example::

    factor = StepFactor(inner_optimizer, host_rows=True, host_step=host_step)   # offloaded rows
    with factor.applied(reduced_chunks, coef, host_kernel=host_step.why_not() is None):
        # our kernel's factor, torch's grad_scale, or a multiply
        inner_optimizer.step()

# [Note: the factor in the kernel]
# On offloaded rows a multiply of every gradient row is a read and a write of the whole shard on
# the host, as long as a third of the AdamW kernel itself. torch's fused Adam and AdamW take a
# ``grad_scale`` tensor (GradScaler's hook: an attribute of the optimizer they read at each step)
# and divide every gradient by it as they step it, so the step hands them ``1 / coef`` there and
# multiplies nothing. ``x / (1 / c)`` and ``x * c`` are the same number when ``c`` is a power of
# two (the fp16 loss scale, without clipping): an unclipped step is bit-equal to the multiply. A
# clipping factor rounds differently in the last bit of some gradient elements (one rounding
# either way). The kernel writes the divided gradient back into the rows, as the multiply did.
# The attribute lives only for the step (``applied``), so no other caller of the inner optimizer's
# ``step`` is scaled. Where our host kernel steps the rows instead ([Note: our kernel in torch's
# place] in ``host/adam_step.py``), it takes ``coef`` itself and multiplies as it reads: the device
# path's rounding, and no division (a divide per element cost 10% of the kernel's time on the CPU).
# Every other inner optimizer, and rows on the device, get the multiply.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from hf_lowzero.zero.host.adam_step import HostAdamStep
from hf_lowzero.zero.update.step import scale_rows

TAKES_GRAD_SCALE: tuple[type[torch.optim.Optimizer], ...] = (torch.optim.Adam, torch.optim.AdamW)


class StepFactor:
    """Where the factor of [Note: one multiply] goes: into the fused host kernel ([Note: the factor
    in the kernel]) when the inner optimizer is one that takes it and its rows are in host memory,
    otherwise a multiply of the gradient rows."""

    def __init__(
        self, optimizer: torch.optim.Optimizer, *, host_rows: bool, host_step: HostAdamStep | None = None
    ) -> None:
        self.optimizer, self.host_rows, self.host_step = optimizer, host_rows, host_step
        self.divisor = torch.ones((), dtype=torch.float32)  # the kernel divides the gradients by it

    def in_kernel(self) -> bool:
        """Whether this step's kernel takes the factor (its groups' kernel may change between steps)."""
        if not self.host_rows or type(self.optimizer) not in TAKES_GRAD_SCALE:
            return False
        return all(group.get("fused") for group in self.optimizer.param_groups)

    @contextlib.contextmanager
    def applied(self, reduced: list[torch.Tensor | None], coef: float, *, host_kernel: bool) -> Iterator[None]:
        """Within: the factor ``coef`` applies to ``reduced`` (this rank's gradient chunks) for the
        inner optimizer's step, once. ``host_kernel``: our host kernel steps this time (``why_not()``
        of the host step is None, asked once by the caller); otherwise ``reduced`` are fp32 rows."""
        if coef != 1.0 and self.host_step is not None and host_kernel:
            self.host_step.grad_factor = coef  # our kernel multiplies as it reads ([Note: our kernel in torch's place])
            try:
                yield
            finally:
                self.host_step.grad_factor = None
            return
        if coef == 1.0 or not self.in_kernel():
            scale_rows(reduced, coef)
            yield
            return
        self.divisor.fill_(1.0 / coef)
        self.optimizer.grad_scale = self.divisor
        try:
            yield
        finally:
            del self.optimizer.grad_scale
