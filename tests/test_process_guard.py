"""No process of ours outlives the one that started it (``hf_lowzero/process_guard.py``, issue 55):
a parent killed with SIGKILL takes its children along."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs Linux's /proc")


def children_of(pid: int) -> list[int]:
    """The pids whose parent is ``pid`` (from /proc)."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            stat = (entry / "stat").read_text()
        except (OSError, ValueError):
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
            found.append(int(entry.name))
    return found


def alive(pid: int) -> bool:
    """Running (a zombie left for a reaper counts as gone)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def descendants_of(pid: int, depth: int) -> list[list[int]]:
    """The children of ``pid``, their children, ... ``depth`` generations, one list per generation."""
    generations = [children_of(pid)]
    while len(generations) < depth:
        generations.append([grandchild for kid in generations[-1] for grandchild in children_of(kid)])
    return generations


def kill_parent_and_check_child_gone(parent: subprocess.Popen, wait_for_child_s: float, depth: int = 1) -> None:
    """Wait until ``parent`` has descendants ``depth`` generations down, kill it, and check they all die."""
    deadline = time.monotonic() + wait_for_child_s
    while not all(generations := descendants_of(parent.pid, depth)):
        assert parent.poll() is None, f"the parent ended before starting its child: {parent.communicate()}"
        assert time.monotonic() < deadline, f"the parent started no descendants {depth} generations down"
        time.sleep(0.1)
    kids = [pid for generation in generations for pid in generation]
    os.kill(parent.pid, signal.SIGKILL)
    parent.wait()
    deadline = time.monotonic() + 10
    while any(alive(kid) for kid in kids) and time.monotonic() < deadline:
        time.sleep(0.1)
    left = [kid for kid in kids if alive(kid)]
    for kid in left:  # do not leave them to burn a core after a failure either
        os.kill(kid, signal.SIGKILL)
    assert not left, f"children {left} outlived their killed parent {parent.pid}"


def test_a_tied_child_dies_with_its_parent():
    parent_code = (
        "import sys; from hf_lowzero.process_guard import run_tied; "
        "run_tied([sys.executable, '-c', 'import time; time.sleep(600)'])"
    )
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    parent = subprocess.Popen([sys.executable, "-c", parent_code], env=env, stderr=subprocess.PIPE)
    kill_parent_and_check_child_gone(parent, wait_for_child_s=120)


def test_a_killed_plan_leaves_no_simulation_running(tmp_path):
    """A plan killed by its caller's timeout took its fake-GPU simulation child along (it used to run
    on, orphaned, at 80% of a core for an hour)."""
    argv = _tiny_plan_argv(tmp_path)
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    command = [sys.executable, "-m", "hf_lowzero.trainer.plan_cli", *argv]
    plan = subprocess.Popen(command, env=env, stderr=subprocess.PIPE)
    kill_parent_and_check_child_gone(plan, wait_for_child_s=300)


@pytest.mark.slow  # the one-process plan above stays in the fast tier; the same guard ties both
def test_a_killed_plan_in_two_processes_leaves_neither_running(tmp_path):
    """A plan whose steps run in two fake-GPU processes ([Note: two processes for a large model] in
    hf_lowzero/plan/simulations.py): killing the command takes the first, and the first the second."""
    from hf_lowzero.plan.simulations import PROCESSES_ENV

    argv = _tiny_plan_argv(tmp_path)
    env = dict(os.environ, PYTHONPATH=str(ROOT), **{PROCESSES_ENV: "2"})
    command = [sys.executable, "-m", "hf_lowzero.trainer.plan_cli", *argv]
    plan = subprocess.Popen(command, env=env, stderr=subprocess.PIPE)
    kill_parent_and_check_child_gone(plan, wait_for_child_s=300, depth=2)


def _tiny_plan_argv(tmp_path) -> list[str]:
    """The plan command's flags for a tiny GPT-2 saved in ``tmp_path``; skips where the plan would not
    simulate in a process of its own (a machine with CUDA, or no fake-CUDA library)."""
    from hf_lowzero.plan.measure import tiny_model_spec
    from hf_lowzero.simulation.launch import FakeCudaUnavailable, fake_cuda_here, fake_cuda_library

    if fake_cuda_here():
        pytest.skip("this machine has CUDA: the plan simulates in its own process")
    try:
        fake_cuda_library()
    except FakeCudaUnavailable as e:
        pytest.skip(str(e))
    tiny_model_spec("gpt2").config.save_pretrained(tmp_path / "model")
    return ["--model", str(tmp_path / "model"), "--world-size", "2", "--seq-len", "32", "--device-memory", "1GiB"]
