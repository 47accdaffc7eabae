"""The time model (hf_lowzero/timing): the cost model's formulas, the schedule of hand-built
sequences (two streams, an event wait, a collective overlapping compute) with the exact times the
model gives, and the sequence a simulated step records.
"""

from __future__ import annotations

import pytest
import torch

from hf_lowzero.timing import Costs, Program, Target, find_device, parse_bandwidth, schedule
from hf_lowzero.timing.costs import MATMUL_EFFICIENCY, MEMORY_EFFICIENCY
from hf_lowzero.timing.counting import OpWork, op_work

H100 = Target.of("H100", gpus_per_node=4, inter_node="100Gb/s")


def test_a_kernel_costs_the_larger_of_its_flops_and_its_bytes_plus_a_launch():
    costs, device = Costs(H100), H100.device
    compute_bound = OpWork(flops=2 * 4096**3, nbytes=3 * 4096**2 * 2, matmul_dtype="bf16", launches=True)
    memory_bound = OpWork(flops=0.0, nbytes=2**30, matmul_dtype="bf16", launches=True)
    matmul = device.matmul_flops["bf16"] * MATMUL_EFFICIENCY
    bandwidth = device.memory_bandwidth * MEMORY_EFFICIENCY
    assert costs.kernel(compute_bound) == pytest.approx(2 * 4096**3 / matmul + device.launch_s)
    assert costs.kernel(memory_bound) == pytest.approx(2**30 / bandwidth + device.launch_s)
    fp32 = OpWork(flops=2 * 4096**3, nbytes=0, matmul_dtype="fp32", launches=True)
    assert costs.kernel(fp32) == pytest.approx(2 * 4096**3 / (67e12 * MATMUL_EFFICIENCY) + device.launch_s)
    assert costs.kernel(OpWork(0.0, 0, "fp32", launches=False)) == 0.0  # a view


def test_collectives_cost_latency_plus_ring_bytes_over_the_links_they_cross():
    costs, device, size = Costs(H100), H100.device, 2**28
    within = 450e9  # NVLink per direction; the group of 4 fits a node of 4
    across = 12.5e9  # 100 Gb/s between nodes
    assert costs.collective("all_reduce", size, 4) == pytest.approx(device.latency_s + 2 * 3 / 4 * size / within)
    assert costs.collective("reduce_scatter", size, 4) == pytest.approx(device.latency_s + 3 / 4 * size / within)
    assert costs.collective("all_gather", size, 8) == pytest.approx(device.latency_s + 7 / 8 * size / across)
    assert costs.collective("all_gather", size, 1) == device.launch_s  # one rank sends nothing


def test_the_schedule_of_two_streams_and_an_event_wait():
    """compute: A then B; the side stream waits for an event after A, then copies; the host waits
    for the copy and ends the step."""
    costs = Costs(H100)
    a = OpWork(flops=2e12, nbytes=0, matmul_dtype="bf16", launches=True)
    b = OpWork(flops=1e12, nbytes=0, matmul_dtype="bf16", launches=True)
    program = Program()
    program.steps.append(("run", "compute", "kernel", a))
    after_a = program.mark("compute")
    program.steps.append(("wait", "side", after_a))
    program.steps.append(("run", "side", "copy", 2**30))
    program.steps.append(("run", "compute", "kernel", b))
    program.steps.append(("wait", "host", program.mark("side")))
    program.steps.append(("boundary",))
    timeline = schedule(program, costs)

    d = H100.device.dispatch_s
    a_end = d + costs.kernel(a)  # issued after one dispatch
    copy_end = max(a_end, 2 * d) + costs.copy(2**30)  # waits for A's event, issued second
    b_end = a_end + costs.kernel(b)  # queued behind A on compute
    assert timeline.lanes["side"] == [(pytest.approx(a_end), pytest.approx(copy_end), "copy")]
    assert timeline.lanes["compute"][1][1] == pytest.approx(b_end)
    assert timeline.step_time().seconds == pytest.approx(max(copy_end, b_end))


def test_a_collective_overlapping_compute_is_hidden_by_the_overlap():
    costs = Costs(H100)
    short = OpWork(flops=1e11, nbytes=0, matmul_dtype="bf16", launches=True)
    long = OpWork(flops=2e12, nbytes=0, matmul_dtype="bf16", launches=True)
    program = Program()
    program.steps.append(("boundary",))  # the step starts here
    program.steps.append(("run", "compute", "kernel", short))
    program.steps.append(("wait", "nccl", program.mark("compute")))
    program.steps.append(("run", "nccl", "collective", ("reduce_scatter", 2**31, 4)))
    done = program.mark("nccl")
    program.steps.append(("run", "compute", "kernel", long))
    program.steps.append(("wait", "compute", done))
    program.steps.append(("run", "compute", "kernel", short))
    program.steps.append(("boundary",))
    timeline = schedule(program, costs)

    d = H100.device.dispatch_s
    short_end = d + costs.kernel(short)
    comm = costs.collective("reduce_scatter", 2**31, 4)
    comm_end = max(short_end, 2 * d) + comm
    long_end = short_end + costs.kernel(long)
    assert comm_end > long_end  # part of it sticks out past the long kernel
    step = timeline.step_time()
    assert step.seconds == pytest.approx(comm_end + costs.kernel(short))  # compute waits for it, then runs
    assert step.comm_seconds == pytest.approx(comm)
    assert step.comm_hidden == pytest.approx((long_end - (comm_end - comm)) / comm)


def test_an_op_counts_its_flops_and_bytes():
    a, b = torch.ones(16, 32, dtype=torch.bfloat16), torch.ones(32, 8, dtype=torch.bfloat16)
    out = a @ b
    work = op_work(torch.ops.aten.mm.default, (a, b), {}, out)
    assert work == OpWork(
        flops=2 * 16 * 32 * 8, nbytes=(16 * 32 + 32 * 8 + 16 * 8) * 2, matmul_dtype="bf16", launches=True
    )
    view = op_work(torch.ops.aten.view.default, (a, [32, 16]), {}, a.view(32, 16))
    assert not view.launches


def test_devices_and_bandwidths_are_read_or_refused_clearly():
    assert find_device("h100").name == "H100" and find_device("a100").name == "A100-80GB"
    assert parse_bandwidth("400Gb/s") == 50e9 and parse_bandwidth("50GB/s") == 50e9 and parse_bandwidth(2) == 2e9
    with pytest.raises(ValueError, match="--device 'B200' is not one the plan knows; use one of H100"):
        find_device("B200")
    with pytest.raises(ValueError, match="bandwidth 'fast' is not understood; give it as 400Gb/s"):
        Target.of("H100", inter_node="fast")
    with pytest.raises(ValueError, match="gpus_per_node must be at least 1"):
        Target.of("H100", gpus_per_node=0)
