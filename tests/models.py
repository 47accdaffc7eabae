"""Small models and references shared by the distributed tests."""

from __future__ import annotations

import copy

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP


class BranchyNet(nn.Module):
    """Odd shapes that need padding at every world size, plus every kind of (un)used parameter.

    ``branch_a``/``branch_b`` are used or not depending on the flags passed to ``forward`` (tests
    vary them by rank and step); ``never`` is used by no rank; ``frozen`` has requires_grad=False.
    """

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.embed = nn.Linear(17, 257)
        self.frozen = nn.Linear(257, 31)
        self.frozen.requires_grad_(False)
        self.branch_a = nn.Linear(31, 13)
        self.branch_b = nn.Linear(31, 13)
        self.never = nn.Linear(31, 5)
        self.head = nn.Linear(13, 3)
        self.scale = nn.Parameter(torch.ones(7))

    def forward(self, x: torch.Tensor, use_a: bool = True, use_b: bool = True) -> torch.Tensor:
        h = self.frozen(torch.tanh(self.embed(x)))
        out = h.new_zeros(h.shape[0], 13)
        if use_a:
            out = out + self.branch_a(h)
        if use_b:
            out = out + torch.sin(self.branch_b(h))
        return self.head(torch.tanh(out)) * self.scale[:3].sum()


def param_groups(model: nn.Module, lr: float = 1e-2, weight_decay: float = 0.1) -> list[dict]:
    """Two groups with different lr and weight decay (Trainer-style decay / no-decay split)."""
    trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    decay = [p for n, p in trainable if n.endswith("weight")]
    no_decay = [p for n, p in trainable if not n.endswith("weight")]
    return [
        {"params": decay, "lr": lr, "weight_decay": weight_decay},
        {"params": no_decay, "lr": lr * 0.5, "weight_decay": 0.0},
    ]


def make_inner(kind: str, model: nn.Module) -> torch.optim.Optimizer:
    groups = param_groups(model)
    if kind == "adamw":
        return torch.optim.AdamW(groups, betas=(0.9, 0.95))
    if kind == "sgd":
        return torch.optim.SGD(groups, momentum=0.9)
    if kind == "adagrad":  # creates its state in the constructor
        return torch.optim.Adagrad(groups, initial_accumulator_value=0.1)
    if kind == "adafactor":  # factored second moments: exact only on whole tensors
        return torch.optim.Adafactor(groups, lr=1e-2)
    raise ValueError(kind)


def ddp_reference(model: nn.Module) -> DDP:
    """A DDP copy of ``model`` with DDP's unused-parameter semantics."""
    return DDP(copy.deepcopy(model), find_unused_parameters=True)


def batch(rank: int, step: int, micro: int = 0, size: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * rank + 17 * step + micro)
    return torch.randn(size, 17, generator=g), torch.randn(size, 3, generator=g)


def assert_params_equal(zero_model: nn.Module, ref_model: nn.Module, where: str, rtol=1e-5, atol=1e-5) -> None:
    """Equal up to summation-order rounding (gloo sums ranks in a size-dependent order; Adam
    amplifies rounding where |g| ~ eps). A real bug (a missed average, mask or clip) is ~lr = 1e-2."""
    for (name, p), (_, q) in zip(zero_model.named_parameters(), ref_model.named_parameters()):
        torch.testing.assert_close(p, q, rtol=rtol, atol=atol, msg=lambda m, name=name: f"{where}: param {name}: {m}")


class MasterWeightReference:
    """The unsharded math ZeRO must reproduce for low-precision params: DDP on the 16-bit model,
    an fp32 master copy of every param updated by the same inner optimizer, the same loss scale,
    unscale + clip on the full averaged gradients, skip on non-finite, then cast back."""

    def __init__(self, model: nn.Module, inner: str, clip: float = 0.0) -> None:
        self.ddp = ddp_reference(model)
        self.master_model = copy.deepcopy(model).float()
        self.opt = make_inner(inner, self.master_model)
        self.clip = clip

    def _pairs(self):
        return [(p, m) for p, m in zip(self.ddp.module.parameters(), self.master_model.parameters()) if m.requires_grad]

    def collect(self) -> None:
        """Move the (synced) 16-bit gradients into fp32 master gradients, adding to what is there.
        Called after every micro-batch this mirrors stage 2 (fp32 accumulation of reduced grads);
        called once per step after no_sync micro-batches it mirrors stage 1."""
        for p, m in self._pairs():
            if p.grad is not None:
                m.grad = p.grad.float() if m.grad is None else m.grad + p.grad.float()
                p.grad = None

    def step(self, scale: float) -> bool:
        self.collect()
        masters = [m for _, m in self._pairs()]
        for m in masters:
            if m.grad is not None:
                m.grad /= scale
        norm = torch.nn.utils.clip_grad_norm_(masters, self.clip or float("inf"))
        applied = bool(torch.isfinite(norm))
        if applied:
            self.opt.step()
            with torch.no_grad():
                for p, m in self._pairs():
                    p.copy_(m)
        self.opt.zero_grad()
        return applied
