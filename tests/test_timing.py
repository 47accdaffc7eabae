"""The time model (hf_lowzero/timing): the cost model's formulas, the schedule of hand-built
sequences (two streams, an event wait, a collective overlapping compute) with the exact times the
model gives, and the sequence a simulated step records.
"""

from __future__ import annotations

import collections
import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from hf_lowzero.plan.measure import PlanCase, case_training, tiny_model_spec
from hf_lowzero.plan.simulate import simulate_step
from hf_lowzero.plan.step_records import Setup
from hf_lowzero.timing import Costs, Program, Target, calibrate, find_device, parse_bandwidth, schedule
from hf_lowzero.timing.costs import MATMUL_EFFICIENCY, MEMORY_EFFICIENCY
from hf_lowzero.timing.counting import PER_ELEMENT_MATH, OpWork, is_query, op_work, with_cpu_attention
from hf_lowzero.trainer.plan_cli import main as plan_main

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


def test_the_steps_flops_are_those_it_issues_though_the_host_runs_ahead():
    """Stage 0 on a GPU waits for nothing: the host issues the step's kernels while the previous
    update still runs, before the step's start on the timeline. Its FLOPs are the step's (its MFU
    read 0 while they were counted by the time they were issued)."""
    costs = Costs(H100)
    update = OpWork(flops=4e12, nbytes=0, matmul_dtype="bf16", launches=True)
    forward = OpWork(flops=3e12, nbytes=0, matmul_dtype="bf16", launches=True)
    program = Program()
    program.steps.append(("run", "compute", "kernel", update))
    program.steps.append(("boundary",))
    program.steps.append(("run", "compute", "kernel", forward))
    program.steps.append(("run", "compute", "kernel", forward))
    program.steps.append(("boundary",))
    timeline = schedule(program, costs)

    d = H100.device.dispatch_s
    assert 3 * d < timeline.boundaries[0]  # the step's kernels were issued before it began
    step = timeline.step_time()
    assert step.flops == 6e12 and timeline.flops == [4e12, 6e12]
    assert step.seconds == pytest.approx(2 * costs.kernel(forward))


def test_an_op_counts_its_flops_and_bytes():
    a, b = torch.ones(16, 32, dtype=torch.bfloat16), torch.ones(32, 8, dtype=torch.bfloat16)
    out = a @ b
    work = op_work(torch.ops.aten.mm.default, (a, b), {}, out)
    nbytes = (16 * 32 + 32 * 8 + 16 * 8) * 2
    assert (work.flops, work.nbytes, work.matmul_dtype, work.launches) == (2 * 16 * 32 * 8, nbytes, "bf16", True)
    view = op_work(torch.ops.aten.view.default, (a, [32, 16]), {}, a.view(32, 16))
    assert not view.launches
    assert not op_work(torch.ops.prim.device.default, (a,), {}, a.device).launches  # a query
    assert is_query(torch.ops.prim.device.default) and is_query(torch.ops.aten.sym_size.int)
    assert not is_query(torch.ops.aten.mm.default) and not is_query(torch.ops.aten.view.default)
    added = op_work(torch.ops.aten._foreach_add_.Scalar, ([a, b], 1.0), {}, None)
    assert added.launches and added.tensors == 2 and work.tensors == 0  # in place, returns nothing; 2 tensors
    q, k = torch.ones(2, 4, 8, 32), torch.ones(2, 4, 128, 32)
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
    attention = with_cpu_attention((q, k, k), op_work(flash, (q, k, k), {}, flash(q, k, k)))
    assert (attention.head_size, attention.tokens) == (32, 128)  # its keys per sequence, not its queries


def test_on_cpu_a_multi_tensor_op_pays_for_each_of_its_tensors():
    """[Note: a cost per tensor]: on ``cpu`` a ``_foreach_*`` or ``_fused_*`` op costs its bytes plus a
    cost per tensor, its own where the calibration measured it (else theirs on average); on a GPU, its
    bytes only. The calibration's figures are the ops' own: more for a norm than for an add."""
    figures = FIXED_CPU | {"per_tensor_s": {"aten._foreach_norm": 2e-6, "aten._foreach_add_": 1e-6}}
    cpu = Costs(Target.of(calibrate.device_from(figures), host_threads=1))
    norm = OpWork(0.0, 8e6, "fp32", True, "aten._foreach_norm", tensors=100)
    other = OpWork(0.0, 8e6, "fp32", True, "aten._foreach_zero_", tensors=100)
    assert cpu.kernel(norm) == pytest.approx(8e6 / 8e9 + 100 * 2e-6)
    assert cpu.kernel(other) == pytest.approx(8e6 / 8e9 + 100 * 1.5e-6)
    assert cpu.kernel(replace(norm, tensors=0)) == pytest.approx(8e6 / 8e9)
    h100 = Costs(Target.of("H100"))
    assert h100.kernel(norm) == h100.kernel(replace(norm, tensors=1))
    measured = calibrate._with_threads(1, calibrate._per_tensor)
    assert measured["aten._foreach_norm"] > measured["aten._foreach_add_"] > 0


def test_devices_and_bandwidths_are_read_or_refused_clearly():
    assert find_device("h100").name == "H100" and find_device("a100").name == "A100-80GB"
    assert parse_bandwidth("400Gb/s") == 50e9 and parse_bandwidth("50GB/s") == 50e9 and parse_bandwidth(2) == 2e9
    with pytest.raises(ValueError, match="--device 'B200' is not one the plan knows; use one of H100"):
        find_device("B200")
    with pytest.raises(ValueError, match="bandwidth 'fast' is not understood; give it as 400Gb/s"):
        Target.of("H100", inter_node="fast")
    with pytest.raises(ValueError, match="gpus_per_node must be at least 1"):
        Target.of("H100", gpus_per_node=0)


# A machine of fixed figures for `--device cpu` (the calibration's cache, written by the test): the
# plan's times are then the same wherever the test runs.
FIXED_CPU = {
    "cpu": "test",
    "threads": 2,
    "matmul_fp32": [50e9, 90e9],
    "matmul_bf16": [100e9, 180e9],
    "bandwidth": [8e9, 12e9],
    "dispatch_s": 10e-6,
    "gloo_latency_s": 100e-6,
    "gloo_bandwidth": 1e9,
}


@pytest.fixture
def fixed_cpu(tmp_path, monkeypatch):
    monkeypatch.setenv(calibrate.CACHE_ENV, str(tmp_path / "cache"))
    path = calibrate.cache_path()
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps(FIXED_CPU))
    return calibrate.device_from(FIXED_CPU)


def test_on_cpu_attention_and_per_element_math_run_at_the_rates_measured_for_them():
    """[Note: the CPU's own rates]: a calibration with them prices the flash attention's FLOPs at its
    attention rate for its head size, a tanh at the bandwidth measured for it, a GELU it has no own figure for at the
    per-element bandwidth, and the matmuls at the share of their rate alone they reached in a step
    ([Note: rates in a step]); other ops, and a calibration without them (an older cache), at the
    matmul rate and the bandwidth."""
    own = FIXED_CPU | {
        "attention": [20e9, 30e9],
        "bandwidth_math": [2e9, 3e9],
        "math": {"aten.tanh": [0.5e9, 1e9]},
        "matmul_step": [0.8, 0.9],
        "attention_by_head": {"32": {"64": [10e9, 20e9], "256": [16e9, 20e9]}, "128": {"64": [30e9, 40e9]}},
    }
    costs, plain = (Costs(Target.of(calibrate.device_from(m), host_threads=1)) for m in (own, FIXED_CPU))
    attention = OpWork(4e9, 2**20, "fp32", True, "aten._scaled_dot_product_flash_attention_for_cpu_backward")
    gelu = OpWork(0.0, 2**24, "fp32", True, "aten.gelu")
    tanh = OpWork(0.0, 2**24, "fp32", True, "aten.tanh")
    add = OpWork(0.0, 2**24, "fp32", True, "aten.add")
    mm = OpWork(4e9, 2**20, "fp32", True, "aten.mm")
    assert costs.kernel(attention) == pytest.approx(4e9 / 20e9)  # no head size: the rate over all
    for head_size, rate in ((16, 10e9), (32, 10e9), (64, 20e9), (128, 30e9), (256, 30e9)):  # a line in log2
        sized = OpWork(4e9, 2**20, "fp32", True, attention.name, head_size=head_size, tokens=64)
        assert costs.kernel(sized) == pytest.approx(4e9 / rate), head_size
    # over more keys, a head of 32 runs faster: 1 / rate = a + b / keys through 10e9 at 64 and 16e9 at 256
    # (a = 0.05, b = 3.2 per GFLOP/s), toward 20e9; one length measured (128): its rate at every length
    for keys, rate in ((64, 10e9), (256, 16e9), (1024, 1 / (0.05 + 3.2 / 1024) * 1e9), (10**9, 20e9)):
        sized = OpWork(4e9, 2**20, "fp32", True, attention.name, head_size=32, tokens=keys)
        assert costs.kernel(sized) == pytest.approx(4e9 / rate, rel=1e-6), keys
        assert costs.kernel(replace(sized, head_size=128)) == pytest.approx(4e9 / 30e9), keys
    assert costs.kernel(gelu) == pytest.approx(2**24 / 2e9)
    assert costs.kernel(tanh) == pytest.approx(2**24 / 0.5e9)
    assert costs.kernel(add) == plain.kernel(add) == pytest.approx(2**24 / 8e9)
    assert costs.kernel(mm) == pytest.approx(4e9 / (0.8 * 50e9)) and plain.kernel(mm) == pytest.approx(4e9 / 50e9)
    assert plain.kernel(attention) == pytest.approx(4e9 / 50e9) and plain.kernel(gelu) == plain.kernel(add)


def test_the_reference_step_counts_its_ops_work_as_torch_counts_it():
    """[Note: rates in a step]: the reference step's clock sees every per-element op the rates are
    for, and counts the matmuls' and the attention's FLOPs as torch's ``FlopCounterMode`` does."""
    from torch.utils.flop_counter import FlopCounterMode

    from hf_lowzero.timing.counting import CPU_ATTENTION
    from hf_lowzero.timing.step_rates import OpClock, reference_step, step_rates

    step = reference_step()
    step()
    with FlopCounterMode(display=False) as torch_count:
        step()
    with OpClock() as clock:
        step()
    counted = collections.Counter(torch_count.get_flop_counts()["Global"])
    matmuls = sum(v[1] for name, v in clock.ops.items() if name.partition("@")[0] not in CPU_ATTENTION)
    attention = {name: v[1] for name, v in clock.ops.items() if name.partition("@")[0] in CPU_ATTENTION}
    torch_matmuls = sum(n for op, n in counted.items() if "attention" not in str(op))
    assert matmuls == torch_matmuls > 0
    assert {name.partition("@")[2] for name in attention} == {"32@64", "64@64", "128@64"}  # each head size apart
    assert all(flops > 0 for flops in attention.values())
    for forward, backward in (("gelu", "gelu_backward"), ("tanh", "tanh_backward"), ("silu", "silu_backward"),
                              ("native_layer_norm", "native_layer_norm_backward"),
                              ("_log_softmax", "_log_softmax_backward_data")):  # fmt: skip
        assert {f"aten.{forward}", f"aten.{backward}"} <= set(clock.ops) & PER_ELEMENT_MATH
    assert all(seconds >= 0 and nbytes > 0 for seconds, _, nbytes in clock.ops.values() if nbytes)
    found = step_rates(threads=1)  # each head size over short keys and long ([Note: rates in a step])
    assert {h: set(by_keys) for h, by_keys in found["attention_by_head"].items()} == dict.fromkeys(
        ("32", "64", "128"), {"64", "256"}
    )
    assert all(rate > 0 for by_keys in found["attention_by_head"].values() for rate in by_keys.values())
    assert {"aten.sum", "aten.gelu", "aten.tanh"} <= set(found["math"])  # the bias gradients' sums too


def test_the_plan_prints_its_time_columns_as_json_from_the_rows_of_its_table(fixed_cpu, tmp_path, capsys):
    tiny_model_spec("gpt2").config.save_pretrained(tmp_path / "model")
    argv = ["--model", str(tmp_path / "model"), "--world-size", "2", "--seq-len", "32", "--device", "cpu"]
    flags = ["--device-memory", "1GiB", "--host-threads", "1", "--bf16", "--per_device_train_batch_size", "2"]
    assert plan_main([*argv, *flags, "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    rows = {(r["stage"], r["offload"]): r for r in plan["rows"]}
    assert set(rows) == {(0, False), (1, False), (1, True), (2, False), (2, True)}
    for row in rows.values():
        assert {"setup", "fits", "peak_bytes", "step_time_s", "tokens_per_s", "comm_hidden", "mfu"} <= set(row)
        assert row["tokens_per_s"] == pytest.approx(2 * 32 / row["step_time_s"])
    assert rows[(1, False)]["step_time_s"] == rows[(2, False)]["step_time_s"]  # one micro-batch: the same code
    fastest = min((r for r in plan["rows"] if r["fits"]), key=lambda r: r["step_time_s"])
    assert plan["recommended"]["step_time_s"] <= fastest["step_time_s"] * 1.01  # within the 1% ties
    assert plan["timed_for"]["device"] == "cpu" and plan["timed_for"]["host_threads"] == 1

    assert plan_main([*argv, *flags]) == 0  # the table: the same rows, the same times
    table = capsys.readouterr().out.split("Time on 2 x cpu")[1].splitlines()
    for row in plan["rows"]:
        line = next(x for x in table if x.startswith(row["setup"] + "  "))
        assert f"{row['step_time_s'] * 1e3:.3g} ms" in line and f"{row['tokens_per_s']:,.0f}" in line


def test_a_step_of_more_tokens_takes_longer_and_stage_2_reduce_scatters_its_gradients(fixed_cpu):
    spec, training = tiny_model_spec("gpt2"), case_training(PlanCase(bf16=True, batch_size=2))
    costs = Costs(Target.of("cpu", host_threads=1))

    def step(setup, seq_len):
        return simulate_step(spec, training, setup, 2, 2, seq_len, backend="gloo")

    short, long = step(Setup(2), 16), step(Setup(2), 64)
    assert schedule(long.program, costs).step_time().seconds > schedule(short.program, costs).step_time().seconds
    sent = [s[3] for s in short.program.steps if s[0] == "run" and s[2] == "collective"]
    params = sum(p.numel() for p in spec.build(torch.bfloat16).parameters())
    reduce_scatters = [nbytes for op, nbytes, group in sent if op == "reduce_scatter"]
    # one bucket of bf16 gradients, padded to the world size per param; then the params gathered back
    assert reduce_scatters and sum(reduce_scatters) == pytest.approx(2 * params, rel=0.01)
    assert {op for op, _, group in sent} == {"reduce_scatter", "all_gather"} and {g for *_, g in sent} == {2}
    ddp = [s[3] for s in step(Setup(0), 16).program.steps if s[0] == "run" and s[2] == "collective"]
    assert [op for op, *_ in ddp] == ["all_reduce"] and ddp[0][1] == 4 * params  # DDP's fp32 gradients


def test_the_simulated_step_issues_the_ops_a_real_step_issues():
    """The recorded step of a tiny GPT-2 (fp32, W = 1, the plain Trainer's clip and update) holds, op by op,
    what the same step on real tensors dispatches; no query of a fake tensor's metadata (1,577 of a
    small GPT-2 step's ops before they were left out)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    spec, training = tiny_model_spec("gpt2"), case_training(PlanCase(bf16=False, batch_size=2))
    program = simulate_step(spec, training, Setup(0), 1, 2, 16, backend="gloo").program
    start, end = [i for i, s in enumerate(program.steps) if s[0] == "boundary"][-2:]
    recorded = collections.Counter(s[3].name for s in program.steps[start:end] if s[0] == "run")
    assert not [name for name in recorded if name.startswith("prim.")]

    model = spec.build(torch.float32)
    optimizer = training.optimizer_cls(model.parameters(), **training.optimizer_kwargs)
    ids = torch.randint(0, model.config.vocab_size, (2, 16))

    def step() -> None:
        model(input_ids=ids, labels=ids).loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), training.zero["clip_grad_norm"])  # as the Trainer
        optimizer.step()
        optimizer.zero_grad()

    class Count(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.ops: collections.Counter = collections.Counter()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if not is_query(func):
                self.ops[str(func.overloadpacket)] += 1
            return func(*args, **(kwargs or {}))

    step()  # the optimizer's state made, as before the recorded step
    with Count() as real:
        step()
    for name in ("aten.mm", "aten.addmm", "aten.mul", "aten.native_layer_norm_backward"):
        assert recorded[name] == real.ops[name], name
    assert sum(recorded.values()) == pytest.approx(sum(real.ops.values()), rel=0.1)  # attention masks made apart


def _trainer_ddp_step(rank: int, world_size: int, out: str) -> None:
    """The ops of one stage-0 LowZeroTrainer step of a tiny GPT-2 (the Trainer's DDP), after two
    (rank 0 writes them)."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from transformers import TrainerCallback

    from hf_lowzero import LowZeroTrainer

    class Count(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.ops: collections.Counter = collections.Counter()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if not is_query(func):
                self.ops[str(func.overloadpacket)] += 1
            return func(*args, **(kwargs or {}))

    class Third(TrainerCallback):
        def __init__(self) -> None:
            self.steps, self.counted = 0, Count()

        def on_step_begin(self, args, state, control, **kwargs):
            self.steps += 1
            if self.steps == 3:
                self.counted.__enter__()

        def on_step_end(self, args, state, control, **kwargs):
            if self.steps == 3:
                self.counted.__exit__(None, None, None)

    torch.manual_seed(0)
    model = tiny_model_spec("gpt2").build(torch.float32)
    ids = torch.randint(0, model.config.vocab_size, (32, 16))
    third = Third()
    trainer = LowZeroTrainer(model=model, args=_ddp_args(out, steps=3), callbacks=[third],
                             train_dataset=[{"input_ids": i, "labels": i} for i in ids])  # fmt: skip
    trainer.train()
    if rank == 0:
        with open(out, "w") as f:
            json.dump(dict(third.counted.ops), f)


def _ddp_args(out: str, steps: int = 1):
    from hf_lowzero import LowZeroTrainingArguments

    return LowZeroTrainingArguments(
        output_dir=str(Path(out).parent / "run"), use_cpu=True, report_to=[], per_device_train_batch_size=2,
        max_steps=steps, logging_steps=10**6, save_strategy="no", zero_stage=0, dataloader_num_workers=0,
        disable_tqdm=True,
    )  # fmt: skip


def test_the_ddp_stand_in_issues_the_ops_of_the_trainers_ddp(tmp_path):
    """[Note: DDP's reducer]: the stage-0 step recorded at W = 2 holds, op by op, what the Trainer's DDP
    step (gloo, W = 2) dispatches for its reducer: per gradient, its write into the bucket, its "used"
    flag and its copy back."""
    from hf_lowzero.plan.step_records import TrainingSpec
    from hf_lowzero.testing import run_distributed
    from hf_lowzero.timing.record import DDP_AFTER_ALL_REDUCE, DDP_MARK_USED, DDP_PER_GRADIENT

    out = str(tmp_path / "ops.json")
    run_distributed(_trainer_ddp_step, 2, out=out)
    real = json.loads(Path(out).read_text())

    spec = tiny_model_spec("gpt2")
    program = simulate_step(spec, TrainingSpec.from_args(_ddp_args(out)), Setup(0), 2, 2, 16, backend="gloo").program
    start, end = [i for i, s in enumerate(program.steps) if s[0] == "boundary"][-2:]
    ran = [s[3] for s in program.steps[start:end] if s[0] == "run" and s[2] != "collective"]
    recorded = collections.Counter(work.name for work in ran)
    gradients = sum(1 for p in spec.build(torch.float32).parameters() if p.requires_grad)
    for name in {name for name, _, _ in DDP_PER_GRADIENT + DDP_MARK_USED + DDP_AFTER_ALL_REDUCE}:
        assert recorded[name] >= gradients, name
        assert recorded[name] == pytest.approx(real.get(name, 0), abs=3), name  # a few of the step's own
