"""The GPU path without a GPU: the review's findings, each shown and fixed.

- The real step on fake CUDA tensors (``hf_lowzero.simulation``): stages 1 and 2, offload,
  fp16/bf16/fp32, accumulation, unused params, whole params, exact reduction (int64 collectives, its
  host syncs, fused kernels kept on a GPU), a snapshot copy, checkpoint save and export, every step
  verified. Every collective is checked against NCCL's rules and compared across ranks, every access
  ordered as CUDA streams and events order it. Rank r trains on ``cuda:r`` with the current device
  left at 0 (no ``torch.cuda.set_device``).
- The reads a per-module wait misses (``read_cases()``): nn.MultiheadAttention, nn.TransformerEncoderLayer
  trained and evaluated after each step (torch's fast paths), a layer pruned before wrapping.
- The plan's step with gradient checkpointing, reentrant and not: each layer recomputed with the
  GPU's attention kernel.
- The simulation can fail: each fix undone (the write gate, the params' device for the offload
  copy's event and for object collectives, export gathering on the device, exact pinned buffers, pinned
  buffers registered under the params' device) is caught.
- What needs no simulation is in ``tests/test_gpu_machine.py`` (exact pinned buffers:
  ``tests/test_pinned_memory.py``).
"""

from __future__ import annotations

import contextlib
import dataclasses
from unittest import mock

import pytest
import torch

from hf_lowzero.simulation import (
    GpuCase,
    NcclRuleError,
    RaceError,
    StaleReadError,
    WrongDeviceError,
    call_on_fake_gpus,
    check_cases,
    default_cases,
    read_cases,
)

# ------------------------------------------------------------------ the step on fake GPUs


def _fake_gpu_runs(world_sizes: tuple[int, ...]) -> dict:
    """In the fake-GPU process: every default case at ``world_sizes``, then each fix undone, then
    the plan's step with gradient checkpointing."""
    cases = [case for case in default_cases() if case.world_size in world_sizes]
    with _warnings_logged() as warned:
        results = check_cases(cases)
    return {"cases": results, "warnings": warned, "undone": _undo_each_fix(), "checkpointing": _checkpointing_runs()}


@contextlib.contextmanager
def _warnings_logged():
    """Within: the library's warnings, as logged (texts)."""
    import logging

    texts: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            texts.append(record.getMessage())

    logger, handler = logging.getLogger("hf_lowzero"), Collect(logging.WARNING)
    logger.addHandler(handler)
    try:
        yield texts
    finally:
        logger.removeHandler(handler)


def _undo_each_fix() -> dict[str, str]:
    """What the simulation reports when a fix is taken back (the bug on today's main, in place)."""
    from hf_lowzero.checkpoint import export
    from hf_lowzero.checkpoint.shards import ShardView
    from hf_lowzero.zero.grads import grad_store
    from hf_lowzero.zero.runtime import comm
    from hf_lowzero.zero.runtime import device as dev
    from hf_lowzero.zero.update import write_gate

    class ViewWhereRowsLive:  # export gathers the rows where they are: host memory with offload
        @staticmethod
        def of(opt):
            return dataclasses.replace(ShardView.of(opt), device=opt.master.flat.device)

    current = dev.current_stream
    undone = {
        "no write gate": (
            GpuCase(2, dtype="bf16"),
            mock.patch.object(write_gate.WriteGate, "before_write", lambda s: None),
        ),
        "no write gate, offload": (
            GpuCase(2, dtype="bf16", offload=True),
            mock.patch.object(write_gate.WriteGate, "before_write", lambda s: None),
        ),
        "offload's event on the current device": (
            GpuCase(2, dtype="bf16", offload=True),
            mock.patch.object(grad_store, "dev", _CurrentDeviceOnly(dev, current)),
        ),
        "export gathers host rows": (
            GpuCase(2, dtype="fp32", offload=True),
            mock.patch.object(export, "ShardView", ViewWhereRowsLive),
        ),
        "object collective on the current device": (
            GpuCase(2, dtype="fp32"),
            mock.patch.object(comm, "dev", _CurrentDeviceKept(dev)),
        ),
    }
    outcome = {}
    for name, (case, undo) in undone.items():
        try:
            with undo:
                check_cases([case])
            outcome[name] = "passed"
        except (RaceError, NcclRuleError) as e:
            outcome[name] = f"{type(e).__name__}: {e}"
    for reduction in ("ddp", "exact"):  # a model that reads a weight outside its module (in its own forward)
        try:
            check_cases([GpuCase(2, dtype="bf16", head_outside=True, reduction=reduction)])
            outcome["head read outside its module", reduction] = "passed"
        except StaleReadError as e:
            outcome["head read outside its module", reduction] = f"{type(e).__name__}: {e}"
    from hf_lowzero.zero.exact import step as exact_step

    with mock.patch.object(exact_step, "dev", _PageableHost(dev)):  # exact mode's flags before the fix
        (result,) = check_cases([GpuCase(2, dtype="bf16", accumulation=2, reduction="exact")])
    outcome["exact flags from pageable memory"] = [site for phase, site in result.runs[0].syncs[-1]["sites"]]
    try:  # [Note: exact pinned memory]: page-locked with the current device (cuda:0) current, as before the fix
        with mock.patch.object(dev, "host_buffer", _registered_on_the_current_device):
            check_cases([GpuCase(2, dtype="bf16", offload=True)])
        outcome["pinned on the current device"] = "passed"
    except WrongDeviceError as e:
        outcome["pinned on the current device"] = f"{type(e).__name__}: {e}"
    rounded = mock.patch.object(
        dev,
        "host_buffer",
        lambda numel, dtype, pin_for, zero=True: torch.zeros(numel, dtype=dtype, pin_memory=pin_for is not None),
    )
    with rounded:
        (result,) = check_cases([GpuCase(2, dtype="bf16", offload=True)])
    outcome["pinned through the caching allocator"] = ", ".join(result.runs[0].caching_pinned)
    return outcome


def _registered_on_the_current_device(numel, dtype, pin_for, zero=True):
    """``device.host_buffer`` before the fix: page-locked with whatever device is current."""
    from hf_lowzero.zero.runtime import device as dev

    if not dev.is_cuda(pin_for):
        return torch.zeros(numel, dtype=dtype)
    return dev.ops().pinned_empty(numel, dtype).zero_()


class _PageableHost:
    """``zero.device`` as exact/step.py used it before the fix: its flags in pageable host memory."""

    def __init__(self, module) -> None:
        self._module = module

    def host_buffer(self, numel, dtype, pin_for, zero=True):
        return self._module.host_buffer(numel, dtype, None, zero)

    def __getattr__(self, name):
        return getattr(self._module, name)


class _CurrentDeviceKept:
    """``zero.device`` as the collectives used it before the fix: NCCL's object collectives left on
    the current device (GPU 0)."""

    def __init__(self, module) -> None:
        self._module = module

    def on_device(self, device):
        return contextlib.nullcontext()

    def __getattr__(self, name):
        return getattr(self._module, name)


class _CurrentDeviceOnly:
    """``zero.device`` as the grad store used it before the fix: the current device's stream (GPU 0)."""

    def __init__(self, module, current) -> None:
        self._module, self._current = module, current

    def current_stream(self, device):
        return self._current(torch.device("cuda", 0))

    def __getattr__(self, name):
        return getattr(self._module, name)


@pytest.fixture(scope="module")
def fake_gpu_w2():
    return call_on_fake_gpus(_fake_gpu_runs, (2,))


def _check_runs(results) -> None:
    for result in results:
        case = result.case
        for run in result.runs:
            assert run.device == f"cuda:{run.rank}", case.label  # the current device stayed cuda:0
            assert run.accesses > 500, case.label  # the checker saw the step
            assert run.caching_pinned == [], (case.label, run.caching_pinned)  # no power-of-two rounding
            # the pinned bytes memory_report() states are those allocated, exactly
            assert run.pinned_reported == run.optimizer_pinned, case.label
            # beyond the few bytes of the step's flags ([Note: one host sync per step] in zero/update/step.py)
            assert (run.optimizer_pinned > 1024) == case.offload, case.label
            assert run.host_tensors_saved > 0 and sum(run.pinned_bytes) >= run.optimizer_pinned, case.label
            assert run.checks == case.steps, case.label  # every step verified, on fake tensors too
        assert result.runs[0].exported_states > 0, case.label
        ops = [c.op for c in result.runs[0].sequence]
        reduction = "all_to_all" if case.partition == "params" else "reduce_scatter"
        assert reduction in ops and "all_reduce" in ops and "all_gather_object" in ops, (case.label, set(ops))
        if case.reduction == "exact":
            _check_exact(result)
            continue
        # [Note: the divide in the collective]: W=2 and 4 average in NCCL's reduce-scatter, no divide pass
        averaged = {c.reduction for c in result.runs[0].sequence if c.op == "reduce_scatter"}
        assert averaged <= {"PREMUL_SUM"}, (case.label, averaged)


def test_exact_mode_on_cuda_params_warns_once_that_the_kernels_are_not_deterministic(fake_gpu_w2):
    """Exact reduction on (fake) CUDA params with torch's deterministic algorithms off: the optimizer says
    what to set, once for the process (however many exact optimizers it builds)."""
    assert sum(result.case.reduction == "exact" for result in fake_gpu_w2["cases"]) >= 1
    about = [text for text in fake_gpu_w2["warnings"] if "deterministic" in text]
    assert about == [
        "[hf_lowzero] reduction='exact' on CUDA with torch's deterministic algorithms off: index_add_ (an "
        "embedding's backward), atomic-add kernels and the memory-efficient attention's backward sum in a "
        "run-dependent order, so runs at different world sizes (or twice at one) will differ despite the exact "
        "reduction. Call torch.use_deterministic_algorithms(True) and set CUBLAS_WORKSPACE_CONFIG=:4096:8 in the "
        "environment before CUDA starts."
    ], fake_gpu_w2["warnings"]


def _check_exact(result) -> None:
    """[Note: exact reduction] on NCCL: gradients travel as int64 and are summed, never averaged in the
    collective (an integer sum is divided once, at the step); each step all-reduces the maxima (MAX)
    before the squares and flags (SUM); the fused AdamW the inner optimizer asked for is kept on a GPU
    (the switch to foreach is for the CPU's fused kernel only: zero/exact/kernels.py)."""
    case = result.case
    for run in result.runs:
        reductions = {(c.op, c.dtype, c.reduction) for c in run.sequence if c.op in ("reduce_scatter", "all_to_all")}
        if case.partition == "rows":
            assert reductions == {("reduce_scatter", "int64", "SUM")}, (case.label, reductions)
            assert run.kernels and all(k == (True, False) for k in run.kernels), (case.label, run.kernels)
        else:  # the gradients to their owners in int64; the updated params back in the params' dtype
            assert ("all_to_all", "int64", None) in reductions, (case.label, reductions)
        all_reduces = [c.reduction for c in run.sequence if c.op == "all_reduce"]
        assert all_reduces[:2] == ["MAX", "SUM"] and all_reduces.count("MAX") == case.steps, (case.label, all_reduces)


def test_the_step_runs_on_fake_gpus_under_nccls_rules(fake_gpu_w2):
    results = fake_gpu_w2["cases"]
    assert {r.case.label for r in results} == {c.label for c in default_cases() if c.world_size == 2}
    _check_runs(results)


def _small_llama():
    """Llama-3's shape family, small: grouped-query attention (8 heads, 2 KV heads), RMSNorm, SwiGLU."""
    from transformers import LlamaConfig

    from hf_lowzero.plan.models import ModelSpec

    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=8,
                         num_key_value_heads=2, vocab_size=256, max_position_embeddings=64,
                         architectures=["LlamaForCausalLM"])  # fmt: skip
    return ModelSpec.from_source(config)


def _checkpointing_runs() -> dict:
    """The attention kernels a checkpointed Llama runs on a fake GPU in forward and in backward, and
    the plan's activations on fake GPUs and fake CPU tensors, with each kind of checkpointing
    (errors as text, so that the other tests of the process stand)."""
    from hf_lowzero.plan.simulate import Setup, TrainingSpec, simulate_step

    spec, runs = _small_llama(), {}
    for reentrant in (False, True):
        try:
            runs["kernels", reentrant] = _attention_kernels(spec, reentrant)
        except Exception as e:
            runs["kernels", reentrant] = f"{type(e).__name__}: {e}"
        kind = {"use_reentrant": reentrant}
        training = TrainingSpec(dtype=torch.bfloat16, optimizer_cls=torch.optim.AdamW, optimizer_kwargs={},
                                gradient_checkpointing=True, checkpointing_kwargs=kind)  # fmt: skip
        for backend in ("nccl", "gloo"):  # fake GPUs, fake CPU tensors
            try:
                step = simulate_step(spec, training, Setup(2), 8, 2, 64, backend=backend)
                runs[backend, reentrant] = (step.device, step.breakdown["activations"])
            except Exception as e:
                runs[backend, reentrant] = f"{type(e).__name__}: {e}"
    return runs


def _attention_kernels(spec, reentrant: bool) -> tuple[list[str], list[str]]:
    """The attention and softmax kernels of one step on fake ``cuda:0``: (forward's, backward's)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils._python_dispatch import TorchDispatchMode

    from hf_lowzero.simulation.attention import gpu_attention

    class Kernels(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.names: list[str] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = func.overloadpacket.__name__
            if "attention" in name or name == "_safe_softmax":  # the math path's softmax
                self.names.append(name)
            return func(*args, **(kwargs or {}))

    device = torch.device("cuda", 0)
    with FakeTensorMode(), gpu_attention():
        model = spec.build(torch.bfloat16, True, {"use_reentrant": reentrant}, device).train()
        with Kernels() as forward:
            loss = model(**spec.batch(2, 64, device)).loss
        with Kernels() as backward:
            loss.backward()
    return forward.names, backward.names


def test_a_checkpointed_layer_recomputes_with_the_gpus_attention(fake_gpu_w2):
    """Gradient checkpointing on fake GPUs, reentrant and not: backward recomputes each layer with the
    kernel its forward ran (memory-efficient attention: the batch has a mask), never the math path's
    softmax, so torch.utils.checkpoint accepts the recomputation and the plan counts the GPU's memory."""
    runs = fake_gpu_w2["checkpointing"]
    assert not [v for v in runs.values() if isinstance(v, str)], runs  # errors, as text
    kernel, layers = "_scaled_dot_product_efficient_attention", _small_llama().config.num_hidden_layers
    for reentrant in (False, True):
        assert runs["kernels", reentrant] == ([kernel] * layers, [kernel, f"{kernel}_backward"] * layers)
    for backend, device in [("nccl", "cuda"), ("gloo", "cpu")]:  # fake GPUs, fake CPU tensors
        (on, non_reentrant), (_, reentrant) = runs[backend, False], runs[backend, True]
        # the same tensors kept, about (reentrant's recomputation used to keep the math path's scores)
        assert on == device and reentrant == pytest.approx(non_reentrant, rel=0.05), (backend, runs)


@pytest.mark.slow  # about a minute: four ranks per case
def test_the_step_runs_on_fake_gpus_at_four_ranks():
    results = call_on_fake_gpus(check_cases, [c for c in default_cases() if c.world_size == 4])
    _check_runs(results)


def test_each_fix_undone_is_caught(fake_gpu_w2):
    undone = fake_gpu_w2["undone"]
    assert undone["no write gate"].startswith("RaceError: the compute stream of cuda:0 writes memory that the side")
    assert undone["no write gate, offload"].startswith("RaceError: the host writes memory that the compute stream")
    assert "non-blocking, pinned" in undone["no write gate, offload"]
    assert undone["offload's event on the current device"].startswith(
        "RaceError: the side 1 stream of cuda:1 reads memory that the nccl stream of cuda:1 accessed "
        "(NCCL reduce_scatter)"
    )
    assert undone["export gathers host rows"].startswith("NcclRuleError: rank 0: a cpu tensor")
    assert "reached NCCL's all_gather" in undone["export gathers host rows"]
    assert undone["object collective on the current device"].startswith(
        "NcclRuleError: rank 1: all_gather_object through cuda:1 with cuda:0 current"
    )
    assert "aten.zeros" in undone["pinned through the caching allocator"]
    assert undone["pinned on the current device"].startswith(
        "WrongDeviceError: cudaHostRegister with cuda:0 current, but this rank's GPU is cuda:1"
    )
    # a third host sync per exact step: the flags' blocking copy to the device
    pageable = undone["exact flags from pageable memory"]
    assert len(pageable) == 3 and "self.host.to(self.device" in pageable[1], pageable
    for reduction in ("ddp", "exact"):  # [Note: every read waits]: the first forward learned where head.* is read
        assert undone["head read outside its module", reduction] == "passed"


def test_the_step_syncs_the_host_once_and_backward_never(fake_gpu_w2):
    """[Note: one host sync per step]: in a step after a step (the gathers in flight into its
    forward), the host waits for the device once, at the step, for the clip and skip decision; with
    offload once more, for the gradients' copies it steps on. Never in the forward, the backward
    hooks or the gathers, verify steps included (every step here is one).

    Exact reduction waits twice at the step ([Note: exact reduction] in zero/exact/__init__.py): for
    the maxima (the conversion back to float needs every rank's maxima and count), then for the
    squares, flags and the integrity table, as "ddp"'s one; the flags go to the device from page-locked
    memory, without a wait of their own."""
    exact_sites = ["zero/exact/step.py", "zero/exact/step.py"]
    for result in fake_gpu_w2["cases"]:
        case = result.case
        for run in result.runs:
            last = run.syncs[-1]
            step = 2 if case.offload or case.reduction == "exact" else 1
            expected = {"forward": 0, "backward": 0, "gather": 0, "step": step}
            assert {phase: last[phase] for phase in expected} == expected, (case.label, run.rank, last["sites"])
            if case.reduction == "exact":
                sites = [site.split(":")[0] for phase, site in last["sites"] if phase == "step"]
                assert sites == exact_sites, (case.label, last["sites"])


def _read_runs() -> dict:
    """In the fake-GPU process: each of ``read_cases()``, its result or the stale read it found (as text)."""
    runs = {}
    for case in read_cases():
        try:
            (runs[case.label],) = check_cases([case])
        except StaleReadError as e:
            runs[case.label] = f"{type(e).__name__}: {e}"
    return runs


def test_torchs_own_modules_read_current_params_with_the_gathers_in_flight():
    """[Note: overlapped all-gather] for the reads a per-module wait misses: an nn.MultiheadAttention
    (its forward reads out_proj's weight and bias without calling out_proj), an
    nn.TransformerEncoderLayer trained and evaluated right after each step (eval under no_grad: torch's
    fast paths read the weights of every child), a layer pruned before wrapping (prune's pre-hook,
    registered before the optimizer's, reads weight_orig). No op reads a param whose gather is in
    flight, and the step runs as in every other case."""
    runs = call_on_fake_gpus(_read_runs)
    assert list(runs) == [case.label for case in read_cases()]
    stale = {label: run for label, run in runs.items() if isinstance(run, str)}
    assert not stale, "\n".join(f"{label}: {error}" for label, error in stale.items())
    _check_runs(list(runs.values()))
