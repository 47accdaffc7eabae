"""The real training step on fake CUDA tensors, one rank at a time, checked as a GPU would run it.

A ``GpuCase`` names a setup (world size, stage, offload, precision, accumulation, unused params,
whole-parameter ownership, how torch's modules in the model read their params: ``READS``).
``simulate_rank`` runs it as one rank: the model on ``cuda:<rank>`` with the current CUDA device
left at 0 (as for a user who moved the model and never called ``torch.cuda.set_device``), the real
``LowLevelZeroOptimizer`` on a ``SimulatedGroup`` that enforces NCCL's rules, ``device.py``'s
streams and events stood in by ``FakeCudaOps`` under an ``AccessChecker``. The rank takes ``steps``
steps of every micro-batch, stages a memory snapshot's side-stream copy after the first and lets the
host read it the way the encoder does, then runs every other writer of the shard
(``copy_params_to_master``, ``load_state_dict``), saves a checkpoint and exports the full optimizer
state. ``check_case`` runs every rank and compares the collectives they issued
(``nccl.compare_sequences``).

Example::

    results = call_on_fake_gpus(check_cases, default_cases())   # from any process (launch.py)
    for r in results:
        print(r.case.label, r.collectives, r.accesses)

# [Note: what a simulation runs]
# Everything of the step runs, on fake tensors: the hooks, bucket packing, collectives (checked,
# recorded, no data moved), copies between device and host, the inner optimizer's kernels, the
# all-gather. What cannot run without data has a stand-in: a scalar read on the host (``.item()``)
# reads 1 (a finite gradient norm: no step is skipped), ``nonzero`` finds nothing (every parameter
# counts as used somewhere, so the unused mask changes nothing), object collectives return this
# rank's object for every rank, and a checkpoint's files hold no tensor data (the tensors reaching
# the writer are checked to be host tensors). Each rank is simulated alone, in turn, in one process.
"""

from __future__ import annotations

import contextlib
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from unittest import mock

import torch
from torch import nn
from torch.nn.utils import prune

from hf_lowzero.simulation.nccl import Collective, NcclRuleError, compare_sequences, simulated_world
from hf_lowzero.simulation.streams import AccessChecker, FakeCudaOps
from hf_lowzero.zero.runtime import device as dev

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
# How the model reads its params (``GpuCase.reads``): each a way torch's own modules read a weight
# outside the forward of the module holding it ([Note: overlapped all-gather] in zero/update/allgather.py).
READS = {
    "modules": "",  # every param read in the forward of a module holding it
    "mha": "an nn.MultiheadAttention (out_proj's weight read by its parent)",
    "encoder": "an nn.TransformerEncoderLayer (and its fast path in eval)",
    "prune": "a layer pruned before wrapping (prune's pre-hook reads weight_orig)",
}
PHASES = ("forward", "backward", "step", "gather")  # where host syncs are counted


@dataclass(frozen=True)
class GpuCase:
    """One setup to simulate on fake GPUs."""

    world_size: int = 2
    stage: int = 2
    dtype: str = "bf16"  # the params' dtype: "fp32", "bf16" or "fp16" (fp32 masters either way)
    offload: bool = False
    accumulation: int = 1  # micro-batches per step (stage 1: the first ones under no_sync)
    unused: bool = False  # a branch only even ranks use, and a layer no rank uses
    partition: str = "rows"  # "rows" (AdamW, row shards) or "params" (Adafactor, whole-param ownership)
    master_dtype: str = "fp32"
    steps: int = 2
    overlap_allgather: bool = True  # the gathers left in flight after the step ([Note: overlapped all-gather])
    head_outside: bool = False  # the model reads the head's weight outside the head's forward (a stale read)
    reads: str = "modules"  # a pattern of torch's modules that reads weights outside their module: READS
    evaluate: bool = False  # an evaluation forward (eval, no_grad: torch's fast paths) right after each step
    reduction: str = "ddp"  # or "exact": int64 sums ([Note: exact reduction] in zero/exact/__init__.py)

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES or self.partition not in ("rows", "params") or self.stage not in (1, 2):
            raise ValueError(f"invalid case {self}")
        if self.reduction not in ("ddp", "exact"):
            raise ValueError(f"invalid case {self}: reduction must be 'ddp' or 'exact'")
        if self.reads not in READS:
            raise ValueError(f"invalid case {self}: reads must be one of {sorted(READS)}")

    @property
    def label(self) -> str:
        parts = [f"W={self.world_size}", f"stage {self.stage}", self.dtype]
        parts += ["offload"] * self.offload + [f"{self.accumulation} micro-batches"] * (self.accumulation > 1)
        parts += ["unused params"] * self.unused + ["whole params"] * (self.partition == "params")
        parts += ["bf16 masters"] * (self.master_dtype == "bf16")
        parts += ["gathers waited in the step"] * (not self.overlap_allgather)
        parts += ["head read outside its module"] * self.head_outside
        parts += [READS[self.reads]] * (self.reads != "modules") + ["evaluated after each step"] * self.evaluate
        parts += ["exact reduction"] * (self.reduction == "exact")
        return ", ".join(parts)


@dataclass
class RankRun:
    """What one simulated rank did."""

    rank: int
    device: str
    sequence: list[Collective]
    accesses: int  # tensor accesses the checker ordered
    pinned_bytes: list[int]  # each pinned buffer's bytes, as allocated (the optimizer's, then the snapshot's)
    optimizer_pinned: int  # bytes of the pinned buffers allocated before the snapshot stager's
    pinned_reported: int  # memory_report().pinned
    caching_pinned: list[str]  # allocations through torch's caching host allocator (rounded up)
    host_tensors_saved: int  # tensors that reached the checkpoint writer (all on the host)
    exported_states: int  # state entries of the full optimizer state dict (rank 0)
    syncs: list[dict[str, int]]  # per step: host syncs per phase (forward, backward, step, gather)
    kernels: list[tuple[bool, bool]]  # per inner group after construction: (fused, foreach)
    checks: int  # verify steps the integrity checker took


@dataclass
class CaseResult:
    case: GpuCase
    runs: list[RankRun] = field(default_factory=list)

    @property
    def collectives(self) -> int:
        return len(self.runs[0].sequence)

    @property
    def accesses(self) -> int:
        return sum(r.accesses for r in self.runs)


class SimNet(nn.Module):
    """Odd shapes (padding at every world size), a branch used by even ranks only, a layer used by
    none and a frozen layer: every kind of parameter the step handles; ``reads``: one of READS."""

    def __init__(self, reads: str = "modules") -> None:
        super().__init__()
        # 48 wide with attention: out_proj.weight (48 x 48) fills a bucket (reduce_bucket_mb=0.004) of its own, so
        # no bucket of the attention's own params holds it
        width = 48 if reads in ("mha", "encoder") else 24
        self.embed = nn.Embedding(97, width)
        self.frozen = nn.Linear(width, width)
        self.frozen.requires_grad_(False)
        self.body = nn.Linear(width, 40)
        self.branch = nn.Linear(40, 40)
        self.never = nn.Linear(40, 5)
        self.head = nn.Linear(40, 97)
        self.scale = nn.Parameter(torch.ones(7))
        self.attention: nn.Module | None = None
        if reads == "mha":
            self.attention = nn.MultiheadAttention(width, 2, batch_first=True)
        elif reads == "encoder":
            self.attention = nn.TransformerEncoderLayer(width, 2, 64, dropout=0.0, batch_first=True)
        elif reads == "prune":
            prune.l1_unstructured(self.body, "weight", amount=0.25)

    def forward(self, ids: torch.Tensor, use_branch: bool, head_outside: bool = False) -> torch.Tensor:
        h = self.frozen(self.embed(ids))
        if isinstance(self.attention, nn.MultiheadAttention):  # self-attention: MHA's own fast path in eval
            h = h + self.attention(h, h, h, need_weights=False)[0]
        elif self.attention is not None:
            h = self.attention(h)
        h = torch.tanh(self.body(h))
        if use_branch:
            h = h + torch.tanh(self.branch(h))
        logits = nn.functional.linear(h, self.head.weight, self.head.bias) if head_outside else self.head(h)
        return logits.float().logsumexp(-1).mean() * self.scale[:3].sum()


class ModalAdamW(torch.optim.AdamW):
    """AdamW with schedule-free's ``train()``/``eval()`` switches, which rewrite the params it steps
    (here by a factor of 1: the writes are what the simulation checks)."""

    @torch.no_grad()
    def _switch(self) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                p.mul_(1.0)

    train = eval = _switch


def fake_storage(model: nn.Module, device: torch.device | str) -> nn.Module:
    """Replace every (meta) param and buffer of ``model`` by an empty tensor on ``device`` of the
    active fake mode, keeping tied weights tied. Assigned directly: a conversion would swap tensors
    (which fake tensors refuse)."""
    made: dict[int, torch.Tensor] = {}

    def fake(t: torch.Tensor) -> torch.Tensor:
        if id(t) not in made:
            empty = torch.empty(t.shape, dtype=t.dtype, device=device)
            made[id(t)] = nn.Parameter(empty, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else empty
        return made[id(t)]

    for module in model.modules():
        for name, param in module._parameters.items():
            if param is not None:
                module._parameters[name] = fake(param)
        for name, buffer in module._buffers.items():
            if buffer is not None:
                module._buffers[name] = fake(buffer)
    return model


def simulate_rank(case: GpuCase, rank: int, workdir: str | Path) -> RankRun:
    """Run ``case`` as ``rank`` on fake GPUs (see the module docstring). Needs fake CUDA in this
    process (``launch.fake_cuda_here``) and no process group."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from hf_lowzero.checkpoint import full_state_dict, save_checkpoint
    from hf_lowzero.snapshot import ShardStager
    from hf_lowzero.zero.optimizer import LowLevelZeroOptimizer
    from hf_lowzero.zero.zero_config import ZeroConfig

    device = torch.device("cuda", rank % 8)  # model.to(f"cuda:{rank}"); the current device stays 0
    checker = AccessChecker()
    ops = FakeCudaOps(checker, device)  # pinned buffers registered under the params' device
    saved: list[torch.Tensor] = []
    with torch.device("meta"):
        model = SimNet(case.reads).to(DTYPES[case.dtype])
    world = simulated_world(case.world_size, rank, device, checker, ops)
    with world as record, FakeTensorMode(), checker, dev.use_ops(ops), _checked_writer(saved):
        model = fake_storage(model, device)
        params = [p for p in model.parameters() if p.requires_grad]
        if case.partition == "rows":  # exact mode asks for the fused kernel: kept on a GPU (exact/kernels.py)
            inner = ModalAdamW(params, lr=1e-3, weight_decay=0.1, fused=case.reduction == "exact" or None)
        else:
            inner = torch.optim.Adafactor(params, lr=1e-2)
        config = ZeroConfig(
            stage=case.stage,
            offload_optimizer=case.offload,
            partition=case.partition,
            master_dtype=case.master_dtype,
            reduce_bucket_mb=0.004,  # several buckets, launched while backward runs
            clip_grad_norm=1.0,
            overlap_allgather=case.overlap_allgather,
            reduction=case.reduction,
            verify_every=1,  # every step checks its reductions and replicas (no host sync in the hooks)
        )
        opt = LowLevelZeroOptimizer(model, inner, config)
        kernels = [(bool(g.get("fused")), bool(g.get("foreach"))) for g in opt.optim.param_groups]
        ids = torch.zeros(4, 9, dtype=torch.long, device=device)
        stager = None
        syncs = []
        use_branch = not case.unused or rank % 2 == 0
        for step in range(case.steps):
            checker.syncs.clear()
            checker.sync_sites.clear()
            for micro in range(case.accumulation):
                last = micro == case.accumulation - 1
                exact = case.reduction == "exact"  # every micro-batch reduced, each its own loss
                local = opt.no_sync() if case.stage == 1 and not last and not exact else contextlib.nullcontext()
                with local:
                    with ops.phase("forward"):
                        loss = model(ids, use_branch, case.head_outside) / (1 if exact else case.accumulation)
                    with ops.phase("backward"):
                        opt.backward(loss)
            with ops.phase("step"):
                opt.step()
                opt.zero_grad()
            syncs.append({phase: checker.syncs[phase] for phase in PHASES} | {"sites": list(checker.sync_sites)})
            if case.evaluate:  # with the gathers in flight, as a loop on the optimizer alone evaluates
                model.eval()
                with ops.phase("forward"), torch.no_grad():
                    model(ids, use_branch, case.head_outside)
                model.train()
            if step == case.steps - 1:  # a memory snapshot's copy, in flight while the Trainer evaluates
                optimizer_pinned = sum(ops.pinned_allocations)
                stager = ShardStager(opt)
                staged = stager.stage(step)
                opt.eval()  # a schedule-free optimizer's switch writes the masters
                opt.train()
        # Every other writer of the shard, right after a step whose copies may still read it.
        opt.load_state_dict(opt.state_dict())
        _read_like_the_encoder(staged)
        opt.copy_params_to_master()
        opt.copy_master_to_params()
        stager.close()
        save_checkpoint(opt, Path(workdir) / f"rank{rank}")
        exported = full_state_dict(opt)
        report = opt.memory_report()
    return RankRun(
        rank=rank,
        device=str(device),
        sequence=list(record.sequence),
        accesses=checker.accesses,
        pinned_bytes=list(ops.pinned_allocations),
        optimizer_pinned=optimizer_pinned,
        pinned_reported=report.pinned,
        caching_pinned=list(checker.caching_pinned),
        host_tensors_saved=len(saved),
        exported_states=len(exported["state"]) if exported is not None else 0,
        syncs=syncs,
        kernels=kernels,
        checks=opt.integrity.checks,
    )


def _read_like_the_encoder(staged) -> None:
    """What ``Staged.encode`` does before checksumming: wait for the copy, then read every buffer
    on the host (the checksums themselves need data)."""
    dev.host_waits(staged.copied)
    try:
        for t in staged.shard.values():
            t.sum()
    finally:
        staged.release()


@contextlib.contextmanager
def _checked_writer(saved: list):
    """Checkpoint files without tensor data ([Note: what a simulation runs]): every tensor reaching
    the writer must be a host tensor, as ``safetensors`` needs."""

    def write(target: Path, tensors: dict) -> None:
        for key, t in tensors.items():
            if t.device.type != "cpu":
                raise NcclRuleError(f"{key} reached the checkpoint writer on {t.device}, not on the host")
        saved.extend(tensors.values())
        Path(target).write_text("\n".join(f"{k} {list(t.shape)} {t.dtype}" for k, t in tensors.items()))

    with mock.patch("hf_lowzero.checkpoint.save._write_tensors", write):
        yield


def check_case(case: GpuCase) -> CaseResult:
    """Every rank of ``case``, then their collectives compared (raises on any rule broken, race
    found or sequence that differs)."""
    result = CaseResult(case)
    with tempfile.TemporaryDirectory(prefix="hf_lowzero_gpu_sim_") as workdir:
        for rank in range(case.world_size):
            result.runs.append(simulate_rank(case, rank, workdir))
    compare_sequences([run.sequence for run in result.runs])
    return result


def check_cases(cases: list[GpuCase]) -> list[CaseResult]:
    """``check_case`` for each, in this process (which must have fake CUDA: ``launch.py``)."""
    return [check_case(case) for case in cases]


def read_cases() -> list[GpuCase]:
    """The reads of torch's own modules that bypass the forward of the module holding the weight
    (READS), with the gathers in flight at W=2: trained, and the encoder evaluated after each step."""
    return [
        GpuCase(2, stage=2, dtype="bf16", reads="mha"),
        GpuCase(2, stage=2, dtype="bf16", reads="encoder"),
        GpuCase(2, stage=2, dtype="bf16", reads="encoder", evaluate=True),
        GpuCase(2, stage=2, dtype="bf16", reads="prune"),
    ]


def default_cases() -> list[GpuCase]:
    """Stages 1 and 2 at W=2 and 4, with offload, fp16/bf16/fp32, accumulation, unused params,
    whole-parameter ownership, bf16 masters, and the all-gathers waited in the step or left in flight;
    exact reduction (int64 sums): row shards at W=2 and 4, whole params and stage 1 with fp16 at W=4."""
    cases = []
    for world_size in (2, 4):
        cases += [
            GpuCase(world_size, stage=2, dtype="bf16"),
            GpuCase(world_size, stage=2, dtype="bf16", overlap_allgather=False),
            GpuCase(world_size, stage=1, dtype="fp16", accumulation=3, unused=True),
            GpuCase(world_size, stage=2, dtype="fp32", offload=True, accumulation=2),
            GpuCase(world_size, stage=2, dtype="bf16", offload=True, unused=True),
            GpuCase(world_size, stage=2, dtype="bf16", partition="params", accumulation=2),
            GpuCase(world_size, stage=1, dtype="bf16", offload=True, partition="params", master_dtype="bf16"),
            GpuCase(world_size, stage=2, dtype="bf16", accumulation=2, reduction="exact"),
        ]
    cases += [
        GpuCase(4, stage=2, dtype="fp32", partition="params", unused=True, reduction="exact"),
        GpuCase(4, stage=1, dtype="fp16", accumulation=3, unused=True, reduction="exact"),
    ]
    return cases
