"""One training step of the real code, under fake tensors (to plan) or on real tensors (to check).

``simulate_step`` builds the user's model, the inner optimizer the Trainer would build from its
arguments and, for a ZeRO stage, the real ``LowLevelZeroOptimizer`` on a process group of the
planned world size; it runs one optimizer step to create the optimizer state, then one full step
(every micro-batch's forward and backward, the update) under a ``MemTracker`` from
``torch.distributed._tools``. With ``fake=True`` it runs under ``FakeTensorMode`` on a fake process
group (``torch.testing._internal.distributed.fake_pg``): nothing is allocated and nothing sent, but
every tensor the real code creates is counted, so a 70B model plans on a laptop. With
``fake=False`` the same code runs on real tensors in a real process group: that is how tests and
``benchmarks/memory_plan.py`` check the plan ([Note: what the simulation leaves out]).

Example::

    training = TrainingSpec.from_args(args)                  # LowZeroTrainingArguments or TrainingArguments
    step = simulate_step(ModelSpec.from_source(cfg), training, Setup(stage=2), world_size=8, batch_size=4, seq_len=1024)
    step.peak, step.breakdown["activations"], step.sent_bytes

# [Note: what the simulation leaves out]
# - The step's gradient norm under ZeRO (data-dependent: ``.item()``) is not simulated: one
#   all-reduce of a few bytes per param, and the clipping factor applied to the rows; the update
#   itself is (``LowLevelZeroOptimizer.apply_update``). At stage 0 the Trainer's clipping is (torch's
#   ``clip_grad_norm_`` reads no value on the host): 1.3-1.5 ms of a 30 ms step of the small models
#   of ``benchmarks/plan_time.py`` on a CPU.
# - DDP cannot be built on fake tensors: stage 0 on several ranks adds DDP's gradient buckets (one
#   copy of the gradients, ``gradient_as_bucket_view=False`` as accelerate builds it) and a ring
#   all-reduce's traffic by count. On real tensors the real DDP runs.
# - Optimizers that do not run on fake tensors (torchao's, bitsandbytes') are replaced by a
#   stateless SGD for the simulated step, and their state is found by stepping the real class on
#   real tensors of the held shapes (``state_probe.py``).
# - [Note: steady state] The tracked step is a second step: the optimizer state exists, as in
#   every step after the first. On real tensors the first is a whole step (one without gradients
#   would skip every param). On fake ones the update alone, on zero gradients, creates the same
#   state at half the cost, except with whole-param ownership: there the communication pool keeps
#   buffers of the uneven exchanges' sizes from the first step on (``buffers.py`` keeps the largest
#   it was asked for), so the first step runs whole there too; measured, skipping it put the peak
#   12% low.
# - [Note: attention on the GPU] On a GPU ``scaled_dot_product_attention`` runs flash or
#   memory-efficient attention, which keep no S x S scores (the dropout mask is regenerated from a
#   seed). On fake GPUs ``hf_lowzero.simulation.attention.gpu_attention`` routes it to those kernels.
#   Where a plan for GPUs runs on fake CPU tensors instead (no fake GPU could be made), the CPU takes
#   the math path with attention dropout, which keeps fp32 scores, mask and softmax per layer; there
#   attention dropout is turned off, where the CPU takes its flash kernel: the GPU's memory. Models
#   with eager attention (T5) keep the scores either way.
# - Not left out: the params' all-gathers in flight ([Note: overlapped all-gather] in
#   zero/update/allgather.py), which no pool holds on a GPU (``memory_report().gather_buffers``).
#   The warm-up's update leaves them pending into the tracked step, as every step leaves them to the
#   next forward, and the tracked update issues them again: the tracker counts each buffer while it
#   lives. (In a tiny GPT-2 on fake GPUs, W=2 to 8, backward's peak stays above them.)
# - Allocator effects (CUDA's caching allocator rounding, fragmentation, the CUDA context) are not
#   tensors: the plan keeps a reserve of device memory for them (``planner.py``).
# - Integrity checks ([Note: integrity checks] in zero/integrity/checker.py) hold, while they are on, their
#   sign table (2 MiB; 8 MiB with 16-bit gradients, 8 probes) and 4 MiB of scratch, and on verify
#   steps at most 6 MiB more at a time (a stack of hashed tensors, a gather of gradient pieces):
#   within the reserve. The simulated step checks nothing.
"""

from __future__ import annotations

import contextlib
import warnings

import torch
import torch.distributed as dist
from torch import nn

from hf_lowzero.plan.fake_world import step_world
from hf_lowzero.plan.models import ModelSpec
from hf_lowzero.plan.state_probe import StateProbe, runs_under_fake_tensors
from hf_lowzero.plan.step_records import PARTS, Setup, SimulatedStep, StepMemory, TrainingSpec
from hf_lowzero.plan.tracker import PeakTracker, storage_bytes
from hf_lowzero.timing.record import StepRecorder
from hf_lowzero.zero.runtime import comm


def simulate_step(
    spec: ModelSpec,
    training: TrainingSpec,
    setup: Setup,
    world_size: int,
    batch_size: int,
    seq_len: int,
    rank: int = 0,
    fake: bool = True,
    ref_model: bool = False,
    backend: str = "nccl",
) -> StepMemory:
    """Run one step of ``setup`` as rank ``rank`` of ``world_size`` and account for its memory (see
    the module docstring). ``fake=False`` needs a real default process group of ``world_size``;
    ``backend`` is the one the fake process group stands for (``"nccl"`` on GPUs, ``"gloo"`` on CPU).

    [Note: planning on fake GPUs] With ``backend="nccl"`` in a process with fake CUDA devices
    (``hf_lowzero.simulation.launch``: ``plan_memory`` plans there) the step runs on fake ``cuda``
    tensors on a process group that enforces NCCL's rules, with ``zero/runtime/device.py``'s streams, events
    and pinned buffers stood in: the branches a GPU run takes, and device and host memory counted
    apart. Elsewhere it runs on fake CPU tensors that take NCCL's code paths where they can."""
    with warnings.catch_warnings():
        # fake tensors' data pointers (read by the optimizer's wrap guard), MemTracker's note on
        # None gradients: neither changes what is counted
        warnings.simplefilter("ignore", UserWarning)
        if fake:
            from hf_lowzero.simulation.launch import fake_cuda_here

            on_fake_gpu = backend == "nccl" and fake_cuda_here()
            if backend == "nccl" and not on_fake_gpu:
                spec = spec.as_on_gpu()  # [Note: attention on the GPU]
            device = torch.device("cuda", 0) if on_fake_gpu else None
        else:
            if not dist.is_initialized() or dist.get_world_size() != world_size:
                raise RuntimeError(f"a real step of world size {world_size} needs a default process group of that size")
            device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else None
            rank = dist.get_rank()
        simulated = SimulatedStep(
            spec=spec,
            training=training,
            setup=setup,
            world_size=world_size,
            batch_size=batch_size,
            seq_len=seq_len,
            rank=rank,
            fake=fake,
            ref_model=ref_model,
            device=device,
            backend=backend,
        )
        with step_world(simulated) as recorder:
            return _run(simulated, recorder)


def _run(simulated: SimulatedStep, recorder: StepRecorder | None) -> StepMemory:
    """One step as ``simulated`` describes it, in the world ``step_world`` made for it.

    [Note: the run's own memory] A real run on a GPU reports the allocator's peak less what the
    device held when it began: the caller's tensors, and what earlier runs left. They leave their
    models: torch's ``ModTracker`` (under ``MemTracker``) keeps the params of a model that ran under
    it alive after it exits, past ``gc.collect()`` (26 of GPT-2's 28 params, reproduced on CPU with
    ``ModTracker`` alone), and so did the optimizer's own hooks until [Note: hooks hold the
    optimizer weakly] in ``zero/grads/backward.py``. Measured on an H100 (torch 2.11), three runs in one
    process: the allocator's peak over the step was 0.92, 0.85 and 0.68 of the plan, the second and
    third counting 130 and 225 MiB that the runs before them left, while the tracked peak of each
    was within 0.6% of the plan. Counted from the run's start it is 0.92, 1.00 and 1.01.
    """
    spec, training, setup, world_size = simulated.spec, simulated.training, simulated.setup, simulated.world_size
    fake, device = simulated.fake, simulated.device
    zero_on = setup.stage > 0
    if device is not None and not fake:
        torch.cuda.synchronize(device)
        held_before = torch.cuda.memory_allocated(device)
    param_dtype = training.dtype if zero_on else torch.float32  # plain Trainer: fp32 params under autocast
    stand_in = fake and not runs_under_fake_tensors(training.optimizer_cls)
    # Built before the tracker starts (PEFT casts its adapters with module conversions, which fake
    # tensors refuse once the tracker holds weak references to them), then counted from the start.
    with torch.device(device) if device is not None and not fake else contextlib.nullcontext():
        model = spec.build(param_dtype, training.gradient_checkpointing, training.checkpointing_kwargs, device)
        reference = _frozen_copy(spec, param_dtype, device) if simulated.ref_model else None
    tracker = PeakTracker()
    tracker.track_external(*(m for m in (model, reference) if m is not None))
    with tracker:
        model.train()
        trainable = [p for p in model.parameters() if p.requires_grad]
        inner = (
            torch.optim.SGD(trainable, lr=0.0)
            if stand_in
            else training.optimizer_cls(trainable, **training.optimizer_kwargs)
        )
        embeddings = _full_precision_embeddings(model, training)
        ddp_buckets = 0
        runner = model
        if zero_on:
            from hf_lowzero.zero.optimizer import LowLevelZeroOptimizer

            config = training.zero_config(setup)
            opt = LowLevelZeroOptimizer(model, inner, config)
            partition = opt.partition
        else:
            opt, partition = None, "-"
            if world_size > 1 and not fake:
                runner = nn.parallel.DistributedDataParallel(model)
            elif world_size > 1:
                ddp_buckets = storage_bytes(trainable)  # [Note: what the simulation leaves out]
        batch = spec.batch(simulated.batch_size, simulated.seq_len, device or "cpu")
        step = _Step(setup, training, runner, opt, inner, device)
        timing = recorder if recorder is not None else _NotTimed()
        timing.start()  # [Note: the step's own sequence] in hf_lowzero/timing/record.py
        step.warm_up(fake, batch, reference)  # [Note: steady state]
        timing.boundary()
        tracker.reset_peak()
        if device is not None and not fake:
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
        sent_before = sum(comm.comm_stats.sent_bytes.values())
        # DDP's all-reduces, in the last micro-batch's backward (the others run under no_sync)
        find_unused = not training.gradient_checkpointing  # the Trainer's DDP default
        ddp = (
            (lambda: timing.ddp_all_reduces(trainable, world_size, find_unused))
            if ddp_buckets
            else contextlib.nullcontext
        )
        step.forward_backward(batch, reference, last=ddp)
        grads_at_peak = tracker.peak_snapshot().get("Gradient", 0)
        all_grads = storage_bytes(p.grad for p in trainable if p.grad is not None)
        step.update(fake)
        timing.boundary()
        sent = sum(comm.comm_stats.sent_bytes.values()) - sent_before
    peak = tracker.peak_on(device) if device is not None else tracker.peak_total()
    allocator_peak = None
    if device is not None and not fake:
        allocator_peak = torch.cuda.max_memory_allocated(device) - held_before
    state = _optimizer_state_bytes(opt, inner, training, stand_in, embeddings)
    if stand_in:
        peak += state  # the stand-in SGD created none ([Note: what the simulation leaves out])
    if opt is None and world_size > 1:
        gradient_bytes = sum(p.numel() * p.dtype.itemsize for p in trainable)
        sent = 2 * gradient_bytes * (world_size - 1) // world_size  # DDP's ring all-reduce
        peak += ddp_buckets

    trainable_ids = {id(p) for p in trainable}
    params = storage_bytes(p for p in model.parameters() if id(p) in trainable_ids)
    frozen = storage_bytes([p for p in model.parameters() if id(p) not in trainable_ids] + list(model.buffers()))
    if reference is not None:
        frozen += storage_bytes(list(reference.parameters()) + list(reference.buffers()))
    if opt is not None:
        report = opt.memory_report()
        master, grad_store, buffers = report.master_rows, report.grad_buffers, report.comm_buffers
    else:
        master, grad_store, buffers = 0, 0, ddp_buckets
    host = master + state + grad_store if setup.offload else 0
    gradients = grad_store + grads_at_peak
    device_peak = peak - host if device is None else peak  # on CPU the host parts share the tracker's device
    on_device = {
        "params": params,
        "gradients": gradients if not setup.offload else grads_at_peak,
        "master": master if not setup.offload else 0,
        "optimizer_state": state if not setup.offload else 0,
        "frozen": frozen,
        "buffers": buffers,
    }
    on_device["activations"] = max(0, device_peak - sum(on_device.values()))
    full_gradients = grad_store if opt is not None else all_grads
    return StepMemory(
        peak=device_peak,
        host=host,
        breakdown={name: on_device[name] for name in PARTS},
        model_states=params + frozen + full_gradients + master + state,
        sent_bytes=int(sent),
        partition=partition,
        rank=simulated.rank,
        owned_numel=_owned_numel(opt, world_size) if partition == "params" else [],
        allocator_peak=allocator_peak,
        device=device.type if device is not None else "cpu",
        program=recorder.program if recorder is not None else None,
    )


class _NotTimed:
    """A real step's stand-in for the recorder: nothing is timed."""

    def start(self) -> None:
        pass

    def boundary(self) -> None:
        pass


def _owned_numel(opt, world_size: int) -> list[int]:
    """Elements of trainable params each rank owns (whole-param ownership)."""
    owned = [0] * world_size
    for slot in opt.slots:
        owned[slot.shard.owner] += slot.shard.numel
    return owned


class _Step:
    """One training step as the Trainer runs it: micro-batches with the last one synchronizing,
    then the update (ZeRO's, or the inner optimizer's under DDP)."""

    def __init__(self, setup: Setup, training: TrainingSpec, runner: nn.Module, opt, inner, device) -> None:
        self.setup, self.training, self.runner, self.opt, self.inner = setup, training, runner, opt, inner
        self.device = device  # of a real step on a GPU (autocast's device type); None on CPU

    def warm_up(self, fake: bool, batch, reference) -> None:
        """Bring the run to the state every later step starts from ([Note: steady state])."""
        whole_params = self.opt is not None and self.opt.partition == "params"
        if not fake or whole_params:
            self.forward_backward(batch, reference)
            self.update(fake)
        elif self.opt is not None:
            self.update(fake)
        else:
            for group in self.inner.param_groups:
                for p in group["params"]:
                    p.grad = torch.zeros_like(p)
            self.update(fake)

    def forward_backward(self, batch, reference, last=contextlib.nullcontext) -> None:
        """Every micro-batch's forward and backward; the last one's within ``last()``."""
        steps = self.training.gradient_accumulation_steps
        for micro in range(steps):
            synced = last() if micro == steps - 1 else contextlib.nullcontext()
            with _no_sync(self.opt, self.runner, last=micro == steps - 1), synced:
                if reference is not None:
                    with torch.no_grad():
                        reference(**batch)
                with _autocast(self.setup, self.training.dtype, self.device):
                    loss = self.runner(**batch).loss / steps
                if self.opt is not None:
                    self.opt.backward(loss)
                else:
                    loss.backward()
                del loss

    def update(self, fake: bool) -> None:
        if self.opt is None:
            clip = self.training.zero.get("clip_grad_norm", 0.0)
            if clip:  # the Trainer clips before the update (accelerate's clip_grad_norm_ is torch's): no host sync
                params = [p for group in self.inner.param_groups for p in group["params"]]
                torch.nn.utils.clip_grad_norm_(params, clip, foreach=True)  # as on real CPU or GPU tensors
            self.inner.step()
            self.inner.zero_grad(set_to_none=True)
            return
        if fake:
            self.opt.apply_update()  # the step without its data-dependent norm ([Note: what the simulation leaves out])
        else:
            self.opt.step()
        self.opt.zero_grad()


def _frozen_copy(spec: ModelSpec, dtype: torch.dtype, device) -> nn.Module:
    """A reference model (DPO, GRPO): the base model again, frozen and in eval mode."""
    base = ModelSpec(spec.config, spec.model_class, name=spec.name)
    reference = base.build(dtype, device=device).eval()
    reference.requires_grad_(False)
    return reference


def _full_precision_embeddings(model: nn.Module, training: TrainingSpec) -> set[int]:
    """Ids of the embedding weights whose state bitsandbytes keeps in 32 bits: ``Trainer`` asks for
    that for every ``nn.Embedding`` under an 8-bit bitsandbytes optimizer; so does the simulation."""
    if "bitsandbytes" not in str(training.optimizer_cls) or training.optimizer_kwargs.get("optim_bits") != 8:
        return set()
    import bitsandbytes

    manager = bitsandbytes.optim.GlobalOptimManager.get_instance()
    weights = set()
    for module in model.modules():
        if isinstance(module, nn.Embedding):
            manager.register_module_override(module, "weight", {"optim_bits": 32})
            weights.add(id(module.weight))
    return weights


def _held(opt, inner) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(the tensor the inner optimizer steps, the model's param it stands for), for each it holds."""
    if opt is None:
        return [(p, p) for group in inner.param_groups for p in group["params"]]
    return opt.inner_param_pairs()


def _probes(training: TrainingSpec, opt, inner, embeddings: set[int]):
    """(probe, shapes of the tensors it stands for) for the held tensors: bitsandbytes' embeddings
    get a probe of their own, in 32 bits ([Note: what the simulation leaves out])."""
    held = _held(opt, inner)
    probe = StateProbe(training.optimizer_cls, training.optimizer_kwargs)
    full = StateProbe(training.optimizer_cls, training.optimizer_kwargs | {"optim_bits": 32})
    return [
        (probe, [tuple(t.shape) for t, p in held if id(p) not in embeddings]),
        (full, [tuple(t.shape) for t, p in held if id(p) in embeddings]),
    ]


def _optimizer_state_bytes(opt, inner, training: TrainingSpec, stand_in: bool, embeddings: set[int]) -> int:
    if not stand_in:
        return storage_bytes(v for entry in inner.state.values() for v in entry.values() if isinstance(v, torch.Tensor))
    return sum(probe.state_bytes(shapes) for probe, shapes in _probes(training, opt, inner, embeddings))


def _no_sync(opt, runner, last: bool):
    if last:
        return contextlib.nullcontext()
    if opt is not None:
        return opt.no_sync() if opt.allows_no_sync else contextlib.nullcontext()
    return runner.no_sync() if isinstance(runner, nn.parallel.DistributedDataParallel) else contextlib.nullcontext()


def _autocast(setup: Setup, dtype: torch.dtype, device: torch.device | None):
    if setup.stage > 0 or dtype == torch.float32:
        return contextlib.nullcontext()
    return torch.autocast(device.type if device is not None else "cpu", dtype=dtype)
