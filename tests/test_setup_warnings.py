"""Warnings about the setup, given once at construction: exact mode on a GPU without deterministic
kernels (issue 54), and an offloaded host step on fewer threads than the machine's share of cores.

The predicates are tested directly; the thread warning also end to end, at construction on a world of
one. The determinism warning on CUDA params is seen in the fake-GPU simulation's exact runs
(``tests/test_gpu_path.py``).
"""

import pytest
import torch
from torch import nn

from hf_lowzero import LowLevelZeroOptimizer
from hf_lowzero.zero.exact import determinism_warning
from hf_lowzero.zero.host.threads import host_threads_warning, machine_cores
from hf_lowzero.zero.runtime import notices


def test_exact_mode_warns_on_cuda_only_while_deterministic_algorithms_are_off():
    assert not torch.are_deterministic_algorithms_enabled()
    text = determinism_warning(torch.device("cuda", 1))
    assert text is not None and "deterministic algorithms off" in text
    assert "torch.use_deterministic_algorithms(True)" in text and "CUBLAS_WORKSPACE_CONFIG=:4096:8" in text
    assert determinism_warning("cpu") is None
    torch.use_deterministic_algorithms(True)
    try:
        assert determinism_warning(torch.device("cuda", 1)) is None
    finally:
        torch.use_deterministic_algorithms(False)


@pytest.mark.parametrize(
    ("threads", "cores", "ranks", "expected"),
    [
        (1, 64, 8, "on 1 thread per rank, while this machine has 64 cores for 8 ranks: set OMP_NUM_THREADS=8 "),
        (4, 64, 8, "on 4 threads per rank, while this machine has 64 cores for 8 ranks: set OMP_NUM_THREADS=8 "),
        (1, 2, 1, "on 1 thread per rank, while this machine has 2 cores for 1 rank: set OMP_NUM_THREADS=2 "),
        (8, 64, 8, None),  # the machine's share
        (12, 64, 8, None),  # more than its share: not ours to judge
        (1, 10, 8, None),  # no whole core more per rank
        (1, 1, 1, None),
    ],
)
def test_the_thread_warning_names_the_share_of_cores_a_rank_could_use(threads, cores, ranks, expected):
    text = host_threads_warning(threads, cores, ranks)
    if expected is None:
        assert text is None
    else:
        assert expected in text and f"torch.set_num_threads({cores // ranks})" in text


def _build(offload: bool, reduction: str = "ddp") -> None:
    model = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3))
    LowLevelZeroOptimizer(model, torch.optim.AdamW(model.parameters()), offload_optimizer=offload, reduction=reduction)


def test_an_offloaded_optimizer_warns_once_when_its_host_step_leaves_cores_idle(single_rank_group, caplog, monkeypatch):
    monkeypatch.setattr(notices, "_GIVEN", set())
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    cores, before = machine_cores(), torch.get_num_threads()
    torch.set_num_threads(1)  # torchrun's OMP_NUM_THREADS=1
    try:
        with caplog.at_level("WARNING", logger="hf_lowzero"):
            _build(offload=True)
            _build(offload=True)  # once per process
            _build(offload=False, reduction="exact")  # no host step; exact on the CPU: nothing to say
        warned = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
        expected = [f"[hf_lowzero] {host_threads_warning(1, cores, 1)}"] if cores > 1 else []
        assert warned == expected
        caplog.clear()
        monkeypatch.setattr(notices, "_GIVEN", set())
        torch.set_num_threads(cores)  # all of them: nothing to say
        with caplog.at_level("WARNING", logger="hf_lowzero"):
            _build(offload=True)
        assert [r.getMessage() for r in caplog.records if r.levelname == "WARNING"] == []
    finally:
        torch.set_num_threads(before)
