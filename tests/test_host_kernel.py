"""Our host Adam/AdamW kernel (``hf_lowzero/zero/host/host_adamw.cpp``) against torch's fused CPU one:
the same bits on every size, with and without weight decay and grad_scale, over several steps
([Note: rounding as torch's fused Adam] in ``hf_lowzero/zero/host/kernel.py``)."""

from __future__ import annotations

import pytest
import torch

from hf_lowzero.zero.host import kernel as host
from hf_lowzero.zero.runtime import native

SIZES = (*range(1, 101), 255, 1023, 4097, 65537)


@pytest.fixture(scope="module")
def kernel() -> host.HostAdamKernel:
    found = host.host_kernel()
    if isinstance(found, native.NativeUnavailable) and "no C++ compiler" in found.why:
        pytest.skip(found.why)
    assert not isinstance(found, native.NativeUnavailable), found.why
    return found


def both_step(
    kernel, hyper, sizes, *, steps=3, scale=None, grad_dtype=torch.float32, out_dtype=None, threads=1, factor=None
):
    """``steps`` steps of torch's fused kernel and of ours from the same params and gradients; the
    two sets of (param, exp_avg, exp_avg_sq, step), and our outs. ``factor``: ours multiplies the
    gradients by it as it reads them; torch gets them multiplied by torch first."""
    g = torch.Generator().manual_seed(len(sizes) + steps)
    params = [torch.randn(n, generator=g) for n in sizes]
    theirs = [p.clone().requires_grad_() for p in params]
    kind = torch.optim.AdamW if hyper.decoupled else torch.optim.Adam
    reference = kind(theirs, lr=hyper.lr, betas=hyper.betas, eps=hyper.eps, weight_decay=hyper.weight_decay, fused=True)
    ours = [(torch.zeros(n), torch.zeros(n), torch.zeros(())) for n in sizes]
    outs = [torch.empty(n, dtype=out_dtype) for n in sizes] if out_dtype else [None] * len(sizes)
    for _ in range(steps):
        grads = [(torch.randn(n, generator=g) * 4).to(grad_dtype) for n in sizes]
        for p, grad in zip(theirs, grads):
            p.grad = grad.float().clone()  # promoted (16-bit); a copy: torch writes the divided gradient back
            if factor is not None:
                p.grad.mul_(factor)  # the device path's multiply of the rows
        if scale is not None:
            reference.grad_scale = torch.tensor(scale)
        reference.step()
        tensors = [host.AdamTensors(p, gr, m, v, s, o) for p, gr, (m, v, s), o in zip(params, grads, ours, outs)]
        kernel.step(tensors, [hyper] * len(sizes), grad_scale=None if scale is None else torch.tensor(scale),
                    threads=threads, grad_factor=factor)  # fmt: skip
    expected = [(t.detach(), *(reference.state[t][k] for k in ("exp_avg", "exp_avg_sq", "step"))) for t in theirs]
    got = [(p, m, v, s) for p, (m, v, s) in zip(params, ours)]
    return expected, got, outs


def assert_bit_equal(expected, got, where):
    for i, (want, have) in enumerate(zip(expected, got)):
        for name, a, b in zip(("param", "exp_avg", "exp_avg_sq", "step"), want, have):
            assert torch.equal(a, b), f"{where}: tensor {i} ({a.numel()} elements): {name} differs"


HYPERS = {
    "adamw": host.AdamHyper(lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1, decoupled=True),
    "adamw, no decay": host.AdamHyper(lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0, decoupled=True),
    "adam, decay": host.AdamHyper(lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.05, decoupled=False),
    "adam": host.AdamHyper(lr=3e-3, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.0, decoupled=False),
    "adamw, large lerp weight": host.AdamHyper(lr=1e-2, betas=(0.3, 0.9), eps=1e-8, weight_decay=0.1, decoupled=True),
}


@pytest.mark.parametrize("name", list(HYPERS))
@pytest.mark.parametrize("scale", [None, 3.0, 2.0**-10])
def test_the_kernel_steps_torchs_fused_adam_bit_for_bit(kernel, name, scale):
    expected, got, _ = both_step(kernel, HYPERS[name], SIZES, scale=scale)
    assert_bit_equal(expected, got, f"{name}, grad_scale {scale}")


@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("factor", [0.3137, 2.0**-10])
def test_a_factor_is_multiplied_as_the_rows_multiply_before_torchs_kernel(kernel, grad_dtype, factor):
    """The step's clip factor ([Note: one multiply]): ours multiplies each gradient as it reads it,
    with the bits of a multiply of the rows followed by torch's kernel (the device path)."""
    expected, got, _ = both_step(kernel, HYPERS["adamw"], SIZES, factor=factor, grad_dtype=grad_dtype)
    assert_bit_equal(expected, got, f"factor {factor}, {grad_dtype} gradients")


def test_a_divisor_and_a_factor_together_are_refused(kernel):
    t = host.AdamTensors(torch.zeros(4), torch.zeros(4), torch.zeros(4), torch.zeros(4), torch.zeros(()))
    with pytest.raises(ValueError, match="not both"):
        kernel.step([t], [HYPERS["adamw"]], grad_scale=torch.tensor(2.0), threads=1, grad_factor=0.5)


def test_a_large_tensor_on_two_threads_is_bit_equal_too(kernel):
    sizes = (8 * 2**20 + 5, 3 * host.BLOCK + 7)  # 8M elements, an odd tail; blocks split over threads
    expected, got, _ = both_step(kernel, HYPERS["adamw"], sizes, steps=2, scale=3.0, threads=2)
    assert_bit_equal(expected, got, "8M on 2 threads")


@pytest.mark.parametrize("grad_dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16])
def test_16bit_gradients_are_promoted_and_the_params_written_in_16_bits(kernel, grad_dtype, out_dtype):
    """The 16-bit gradient gives the bits of its fp32 promotion; the out is ``param.to(out_dtype)``."""
    expected, got, outs = both_step(
        kernel, HYPERS["adamw"], SIZES, scale=2.0, grad_dtype=grad_dtype, out_dtype=out_dtype
    )
    assert_bit_equal(expected, got, f"{grad_dtype} gradients")
    for (param, *_), out in zip(got, outs):
        assert torch.equal(out, param.to(out_dtype))


def test_a_tensor_without_gradient_is_only_copied_into_its_out(kernel):
    param, out = torch.randn(1000), torch.empty(1000, dtype=torch.bfloat16)
    step, before = torch.zeros(()), param.clone()
    stepped = kernel.step([host.AdamTensors(param, None, None, None, step, out)], [HYPERS["adamw"]],
                          grad_scale=None, threads=2)  # fmt: skip
    assert stepped == 0 and torch.equal(param, before) and step.item() == 0
    assert torch.equal(out, param.to(torch.bfloat16))


def test_the_bf16_rounding_is_torchs_on_ties_and_specials(kernel):
    """Round to nearest even on exact ties, and inf, -0.0 and huge values as torch's ``.to(bf16)``."""
    ties = torch.tensor([1.0 + 2**-8, 1.0 + 3 * 2**-8, -(1.0 + 2**-8), 3.3895e38, 0.0, -0.0, 1e-40])
    param, out = ties.clone(), torch.empty(ties.numel(), dtype=torch.bfloat16)
    kernel.step([host.AdamTensors(param, None, None, None, torch.zeros(()), out)], [HYPERS["adamw"]],
                grad_scale=None, threads=1)  # fmt: skip
    assert torch.equal(out.view(torch.int16), ties.to(torch.bfloat16).view(torch.int16))


def test_the_probe_can_fail(kernel):
    """[Note: rounding as torch's fused Adam]: the probe tells the roundings apart; only one fits."""
    roundings = [host.Rounding(w, f) for w in (8, 16) for f in (True, False)]
    fits = [r for r in roundings if host.rounds_as_torch(host.HostAdamKernel(kernel.library, r))]
    assert fits == [kernel.rounding]
