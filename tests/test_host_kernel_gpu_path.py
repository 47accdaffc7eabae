"""The offloaded step with our host kernel on fake GPUs (``hf_lowzero.simulation``): the host steps
the rows bucket by bucket and each bucket's rows (16-bit, written by the kernel) leave for the device
as soon as it is done ([Note: rows sent as stepped] in ``hf_lowzero/zero/update/allgather.py``).
The simulation checks every copy against the host's writes (a race fails it) and NCCL's rules; the
step still syncs the host at most twice, and never in the forward, the backward or the gathers.

On fake tensors the kernel's work is done by torch's own fused ops (``TorchFusedKernel``), which
read and write what ours does, in the same order."""

from __future__ import annotations

from unittest import mock

import pytest
import torch

from hf_lowzero.simulation import GpuCase, call_on_fake_gpus


def _fake_gpu_runs(cases) -> dict:
    from hf_lowzero.simulation import RaceError, check_cases, gpu_step
    from hf_lowzero.zero.host import adam_step
    from hf_lowzero.zero.update import allgather

    taken, uploads = [], []
    step, upload = adam_step.HostAdamStep.step, allgather.ParamGather.upload

    def spied_step(self, after_chunk=None):  # which path each step took, and with a 16-bit copy or not
        ours = step(self, after_chunk)
        taken.append((ours, self.copy is not None))
        return ours

    def spied_upload(self, bucket_index):  # the gather's pending state when each bucket's rows leave
        uploads.append(len(self._uploaded))
        return upload(self, bucket_index)

    plain = mock.patch.object(gpu_step, "ModalAdamW", torch.optim.AdamW)  # the Trainer's AdamW, no modes
    spies = mock.patch.object(adam_step.HostAdamStep, "step", spied_step)
    spies_upload = mock.patch.object(allgather.ParamGather, "upload", spied_upload)
    with plain, spies, spies_upload:
        results = check_cases(cases)
    syncs = {result.case.label: [run.syncs[-1] for run in result.runs] for result in results}
    pinned = {
        result.case.label: [(run.pinned_reported, run.optimizer_pinned) for run in result.runs] for result in results
    }

    def eager_upload(self, bucket_index):  # every bucket's rows sent at the first bucket's end
        for index in range(len(self.buckets)):
            if index not in self._uploaded:
                upload(self, index)

    try:
        with plain, mock.patch.object(allgather.ParamGather, "upload", eager_upload):
            check_cases([cases[0]])
        undone = "passed"
    except RaceError as error:
        undone = f"{type(error).__name__}: {error}"
    return {"syncs": syncs, "pinned": pinned, "taken": taken, "uploads": uploads, "undone": undone}


FAST = [
    GpuCase(2, stage=2, dtype="bf16", offload=True, unused=True),
    GpuCase(2, stage=2, dtype="fp32", offload=True, accumulation=2),
]


@pytest.fixture(scope="module")
def runs():
    return call_on_fake_gpus(_fake_gpu_runs, FAST)


def test_every_offloaded_step_takes_our_kernel_and_sends_rows_bucket_by_bucket(runs):
    assert runs["taken"] and all(ours for ours, _ in runs["taken"])
    assert {copy for _, copy in runs["taken"]} == {True, False}  # 16-bit params: the kernel writes their copy
    assert max(runs["uploads"]) > 0  # a bucket's rows left while later buckets were still being stepped


def test_the_kernels_16bit_copy_is_pinned_and_reported(runs):
    """``memory_report().pinned`` counts the pinned bytes allocated, the kernel's 16-bit copy included."""
    for label, per_rank in runs["pinned"].items():
        for reported, allocated in per_rank:
            assert reported == allocated, label


def test_the_step_syncs_the_host_at_most_twice_and_backward_never(runs):
    for label, per_rank in runs["syncs"].items():
        for last in per_rank:
            assert last["step"] <= 2, (label, last["sites"])
            assert (last["forward"], last["backward"], last["gather"]) == (0, 0, 0), (label, last["sites"])


def test_rows_sent_before_the_kernel_stepped_them_are_caught(runs):
    """The simulation sees the host step's writes: rows sent before their bucket was stepped race
    the kernel's writes."""
    assert runs["undone"].startswith("RaceError: the host writes memory"), runs["undone"]


@pytest.mark.slow
def test_stage_1_fp16_with_accumulation_and_four_ranks_too():
    cases = [GpuCase(2, stage=1, dtype="fp16", offload=True, accumulation=2), GpuCase(4, dtype="bf16", offload=True)]
    runs = call_on_fake_gpus(_fake_gpu_runs, cases)
    assert all(ours for ours, _ in runs["taken"]) and runs["undone"].startswith("RaceError")
    test_the_step_syncs_the_host_at_most_twice_and_backward_never(runs)
