"""The plan's simulated steps, run in this process or split over two.

A plan simulates several steps that do not depend on each other: one per setup at the planned
batch, and stages 0 and 2 at one sample more ([Note: largest batch] in ``planner.py``). Each is a
fresh step in a world of its own (``fake_world.py``), so they may run anywhere: ``Simulations.many``
runs half of them in a second fake-GPU process while this one runs the other half.

Example::

    simulate = Simulations(spec, training, world_size=16, seq_len=2048, backend="nccl", processes=2)
    step = simulate(Setup(2), batch_size=4)                               # one step, here
    steps = simulate.many([(Setup(2), 4), (Setup(0), 4), (Setup(2), 5)])  # in the order asked

# [Note: two processes for a large model]
# A simulated step costs one Python dispatch per op, whatever the tensors' sizes, so a 32-layer
# model takes seconds a step (Llama-3-8B: 10-15 CPU seconds), and a plan five steps before its
# check. A second process runs half of them at once on a second core, but costs its start (torch,
# transformers and the model's code imported: about 10 CPU seconds) and its memory, which a small
# model's whole plan does not take: two processes from 1e9 parameters, on a machine of two cores
# or more, where this process has fake GPUs (a fresh one gets them too). ``HF_LOWZERO_PLAN_PROCESSES``
# (1 or 2) overrides the choice. The steps are the same either way: each runs in its own world, and
# nothing a step counts depends on what ran before it in the process. The second process is tied to
# this one ([Note: parent death] in ``process_guard.py``): a plan killed by its caller's timeout
# takes both along.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from hf_lowzero.plan.models import ModelSpec
from hf_lowzero.plan.simulate import simulate_step
from hf_lowzero.plan.step_records import Setup, StepMemory, TrainingSpec

PROCESSES_ENV = "HF_LOWZERO_PLAN_PROCESSES"
TWO_PROCESSES_FROM = 10**9  # parameters ([Note: two processes for a large model])


def plan_processes(total_params: int) -> int:
    """How many processes a plan's independent steps run in: 1 or 2 ([Note: two processes for a large model]).

    Example::

        plan_processes(8_030_261_248)     # 2 on a machine of 2 cores with fake GPUs here; 1 elsewhere

    Raises:
        ValueError: ``HF_LOWZERO_PLAN_PROCESSES`` is set to something other than 1 or 2.
    """
    from hf_lowzero.simulation.launch import fake_cuda_here

    chosen = os.environ.get(PROCESSES_ENV, "").strip()
    if chosen:
        if chosen not in ("1", "2"):
            raise ValueError(
                f"{PROCESSES_ENV}={chosen!r} is invalid; expected 1 (one process) or 2 (a plan's independent steps "
                f"split over two), or unset it to choose by the model's size"
            )
        return int(chosen)
    large = total_params >= TWO_PROCESSES_FROM and (os.cpu_count() or 1) >= 2
    return 2 if large and fake_cuda_here() else 1


@dataclass(frozen=True)
class Simulations:
    """The steps of one plan: ``spec`` trained as ``training`` on ``world_size`` ranks, ``seq_len``
    tokens per sample; ``processes`` (1 or 2) for ``many``."""

    spec: ModelSpec
    training: TrainingSpec
    world_size: int
    seq_len: int
    ref_model: bool = False
    backend: str = "nccl"
    processes: int = 1

    def __call__(self, setup: Setup, batch_size: int, rank: int = 0) -> StepMemory:
        """One step of ``setup`` at ``batch_size`` as rank ``rank``, simulated in this process."""
        options = dict(rank=rank, ref_model=self.ref_model, backend=self.backend)
        return simulate_step(self.spec, self.training, setup, self.world_size, batch_size, self.seq_len, **options)

    def many(self, jobs: list[tuple[Setup, int]]) -> list[StepMemory]:
        """The steps of ``jobs`` ((setup, batch size) each, as rank 0), in the order asked; with
        ``processes`` 2, split over this process and a second one by their expected cost."""
        if self.processes == 1 or len(jobs) < 2:
            return self.run_here(jobs)
        from hf_lowzero.simulation.launch import call_on_fake_gpus

        here, there = _split(jobs)
        # [Note: parent death]: the thread that starts the second process waits for it to end
        with ThreadPoolExecutor(1) as pool:
            away = pool.submit(call_on_fake_gpus, self.run_here, [jobs[i] for i in there])
            found = dict(zip(here, self.run_here([jobs[i] for i in here])))
            found |= dict(zip(there, away.result()))
        return [found[i] for i in range(len(jobs))]

    def run_here(self, jobs: list[tuple[Setup, int]]) -> list[StepMemory]:
        """The steps of ``jobs``, one after another in this process."""
        return [self(setup, batch_size) for setup, batch_size in jobs]


# A step's cost relative to stage 2's, and a process's start, measured on Llama-3-8B (W=16, 2 cores):
# offload steps the host rows through views of fake host tensors, stage 0 casts under autocast.
_COST = {"offload": 2.0, "stage 0": 1.4, "other": 1.0, "start": 0.3}


def _split(jobs: list[tuple[Setup, int]]) -> tuple[list[int], list[int]]:
    """The indices of ``jobs`` to run here and in the second process: the costliest first, each to
    the side that would finish first."""
    cost = [_COST["offload" if s.offload else "stage 0" if s.stage == 0 else "other"] for s, _ in jobs]
    sides, totals = ([], []), [0.0, _COST["start"]]
    for i in sorted(range(len(jobs)), key=lambda i: -cost[i]):
        side = 0 if totals[0] <= totals[1] else 1
        sides[side].append(i)
        totals[side] += cost[i]
    return sides
