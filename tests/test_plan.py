"""The memory plan: simulated steps against real ones, the model-state formulas, the choice, the
command, and ``zero_stage="auto"`` in the Trainer.

The plan's figures come from the real code under fake tensors; the measured ones from the same
code on real tensors in real gloo ranks (``hf_lowzero.plan.measure``).
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensor
from transformers import GPT2LMHeadModel

from hf_lowzero import LowZeroTrainer, LowZeroTrainingArguments, plan_memory
from hf_lowzero.plan.measure import PlanCase, case_training, check_case, tiny_model_spec
from hf_lowzero.plan.planner import parse_bytes
from hf_lowzero.plan.simulate import Setup, simulate_step
from hf_lowzero.plan.tracker import storage_bytes
from hf_lowzero.testing import run_distributed
from hf_lowzero.timing import calibrate
from hf_lowzero.trainer.plan_cli import main as plan_main
from tests.hf_models import TokenDataset, tiny_gpt2
from tests.test_timing import FIXED_CPU

# What the fast tier checks against real steps: DDP, and ZeRO with an 8-bit optimizer (whole-param
# ownership, state from a probe). The slow tier adds each model family, LoRA, checkpointing,
# accumulation, offload and bf16 masters at W = 1, 2, 4; benchmarks/memory_plan.py checks 30 cases.
FAST_CASES = [
    PlanCase("gpt2", stage=0),
    PlanCase("gpt2", optim="adamw_bnb_8bit", stage=2),
]
SLOW_CASES = [
    PlanCase("gpt2-lora", stage=2, gradient_checkpointing=True),
    PlanCase("bert", stage=2, world_size=1, master_dtype="bf16"),
    PlanCase("t5", stage=1, offload=True, gradient_accumulation_steps=2),
    PlanCase("gpt2", stage=2, world_size=4, bf16=False, gradient_checkpointing=True),
    PlanCase("bert", stage=0, world_size=4, optim="adamw_bnb_8bit"),
    PlanCase("t5", stage=2, world_size=4, offload=True),
    PlanCase("gpt2-lora", stage=1, world_size=2, gradient_accumulation_steps=2),
]


def assert_plan_matches(case: PlanCase) -> None:
    result = check_case(case)
    assert result["model_states_ratio"] == pytest.approx(1.0, abs=0.01), result
    assert result["peak_ratio"] == pytest.approx(1.0, abs=0.10), result
    # the only traffic the plan leaves out is the norm's all-reduce: a few bytes per param tensor
    assert result["planned_sent"] == pytest.approx(result["measured_sent"], rel=0.01, abs=1024), result


@pytest.mark.parametrize("case", FAST_CASES, ids=lambda c: c.label)
def test_plan_matches_a_real_step(case):
    assert_plan_matches(case)


@pytest.mark.slow
@pytest.mark.parametrize("case", SLOW_CASES, ids=lambda c: c.label)
def test_plan_matches_a_real_step_more(case):
    assert_plan_matches(case)


def owned_numel(psi: int, world_size: int) -> int:
    return math.ceil(psi / world_size)


@pytest.mark.parametrize("world_size", [1, 4])
def test_model_state_formulas(world_size):
    """The README's formulas, per rank, with Ψ trainable params (Adam: two fp32 states per element
    plus a step counter per tensor; rows padded to a multiple of the world size per bucket)."""
    spec = tiny_model_spec("gpt2")
    psi = sum(p.numel() for p in spec.model_class(spec.config).parameters())
    tensors = len(list(spec.model_class(spec.config).parameters()))
    steps = 4 * tensors  # AdamW's step counter: one fp32 scalar per tensor it holds
    fp32 = case_training(PlanCase(bf16=False))
    bf16 = case_training(PlanCase(bf16=True))
    bf16_masters = case_training(PlanCase(bf16=True, master_dtype="bf16"))

    def states(training, setup):
        return simulate_step(spec, training, setup, world_size, 2, 32).model_states

    rows = owned_numel(psi, world_size)
    tolerance = 0.01  # bucket padding and the step counters of tensors a rank holds no rows of
    assert states(fp32, Setup(0)) == pytest.approx(16 * psi + steps, rel=tolerance)  # DDP: 4 + 4 + 8
    for stage in (1, 2):
        # bf16 params, fp32 gradient rows, fp32 masters, fp32 Adam states
        assert states(bf16, Setup(stage)) == pytest.approx(2 * psi + 16 * rows + steps, rel=tolerance)
        assert states(bf16_masters, Setup(stage)) == pytest.approx(2 * psi + 14 * rows + steps, rel=tolerance)
        # fp32 params keep fp32 masters of their own: ZeRO costs 4 bytes per owned element more than DDP
        assert states(fp32, Setup(stage)) == pytest.approx(4 * psi + 16 * rows + steps, rel=tolerance)
    offloaded = simulate_step(spec, bf16, Setup(2, offload=True), world_size, 2, 32)
    on_device = simulate_step(spec, bf16, Setup(2), world_size, 2, 32)
    # host: fp32 masters, Adam states and gradient rows, a bf16 staging copy of the gradient rows, and
    # the bf16 copy of the masters our host kernel writes ([Note: our kernel in torch's place])
    assert offloaded.host == pytest.approx(20 * rows + steps, rel=tolerance)
    moved = offloaded.host - 2 * rows  # the kernel's bf16 copy has no counterpart on the device
    assert offloaded.peak == pytest.approx(on_device.peak - moved, rel=tolerance)


def plan_for(memory, **kwargs):
    args = LowZeroTrainingArguments(output_dir=os.devnull, use_cpu=True, report_to=[], bf16=True, **kwargs)
    return plan_memory(tiny_model_spec("gpt2"), args, world_size=4, device_memory=memory, seq_len=64, backend="gloo")


def test_plan_recommends_the_cheapest_setup_that_fits():
    roomy = plan_for("1GiB", per_device_train_batch_size=2)
    peaks = {(r.stage, r.offload): r.peak_bytes for r in roomy.rows}
    # with room for all, DDP would send as much as ZeRO (bf16 ZeRO sends less: bf16 gradients and
    # params against DDP's fp32 gradients), so the choice is a ZeRO stage without offload
    assert roomy.recommended.offload is False
    assert roomy.recommended.sent_bytes_per_step == min(r.sent_bytes_per_step for r in roomy.rows if not r.offload)
    assert peaks[(0, False)] > peaks[(2, False)] > peaks[(2, True)]
    assert roomy.row(1).peak_bytes == roomy.row(2).peak_bytes  # one micro-batch: the same code runs

    # room for offloaded ZeRO only: the plan takes offload, and says it had to
    between = (peaks[(2, False)] + peaks[(2, True)]) / 2 / 0.9
    tight = plan_for(int(between), per_device_train_batch_size=2)
    assert (tight.recommended.stage, tight.recommended.offload) in ((1, True), (2, True))
    assert "no setup fits without optimizer offload" in tight.reason

    # nothing fits at this batch, but a smaller one would: the plan names it
    crowded = plan_for(int(peaks[(2, True)] / 0.9) - 1, per_device_train_batch_size=2)
    assert crowded.recommended is None
    assert "the largest batch that fits is 1" in crowded.reason


def test_largest_batch_fits_and_one_more_does_not():
    plan = plan_for("12MiB", per_device_train_batch_size=1)
    best = plan.recommended
    assert best is not None and best.max_batch_size > 1
    spec, training = tiny_model_spec("gpt2"), case_training(PlanCase(bf16=True, batch_size=1))
    setup = Setup(best.stage, best.offload)
    fits = simulate_step(spec, training, setup, 4, best.max_batch_size, 64, backend="gloo")
    over = simulate_step(spec, training, setup, 4, best.max_batch_size + 1, 64, backend="gloo")
    assert fits.peak <= plan.usable_memory < over.peak


@pytest.mark.slow  # test tiers (tests/tiers.py): long; shorter tests of this area stay fast
def test_plan_command(tmp_path, capsys):
    config = tiny_model_spec("gpt2").config
    config.save_pretrained(tmp_path / "model")
    out = tmp_path / "plan.json"
    argv = ["--model", str(tmp_path / "model"), "--world-size", "2", "--seq-len", "32"]
    flags = ["--bf16", "--per_device_train_batch_size", "2", "--json", str(out)]
    assert plan_main([*argv, "--device-memory", "1GiB", *flags]) == 0
    text = capsys.readouterr().out
    assert "stage 0 (DDP)" in text and "stage 2 + offload" in text and "Recommended:" in text
    saved = json.loads(out.read_text())
    assert [(r["stage"], r["offload"]) for r in saved["rows"]] == [
        (0, False),
        (1, False),
        (1, True),
        (2, False),
        (2, True),
    ]
    assert saved["recommended"] in saved["rows"]
    assert set(saved["rows"][0]["breakdown"]) == {
        "params", "gradients", "master", "optimizer_state", "frozen", "activations", "buffers"
    }  # fmt: skip
    # the same plan from the Python API (whose arguments say use_cpu, for bf16 to pass here: it
    # would plan CPU ranks; the command plans GPUs)
    api = plan_memory(
        str(tmp_path / "model/config.json"),
        LowZeroTrainingArguments(
            output_dir=os.devnull, use_cpu=True, report_to=[], bf16=True, per_device_train_batch_size=2
        ),
        world_size=2,
        device_memory="1GiB",
        seq_len=32,
        backend="nccl",
    )
    assert [r.peak_bytes for r in api.rows] == [r["peak_bytes"] for r in saved["rows"]]

    assert plan_main([*argv, "--device-memory", "100KiB", "--backend", "gloo"]) == 1  # nothing fits: exit status 1
    assert "Nothing fits" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exited:  # argparse's error line and exit status 2, no traceback
        plan_main([*argv, "--device-memory", "80XB"])
    err = capsys.readouterr().err
    assert exited.value.code == 2 and "error: device_memory='80XB' is invalid" in err and "Traceback" not in err


def test_a_cuda_build_without_a_gpu_plans_on_fake_cpu_tensors_and_says_why(monkeypatch, caplog):
    """``pip install torch`` on a Linux box without a GPU gets a CUDA build, whose CUDA hooks refuse
    fake devices in backward (seen with torch 2.11.0+cu130: the plan crashed with "hasPrimaryContext
    expects a valid device index"). The plan falls back to fake CPU tensors and says what to install."""
    import hf_lowzero.simulation.launch as launch

    monkeypatch.setattr(launch, "_cuda_build", lambda torch_dir: True)  # such a build, with no GPU visible
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    assert not launch.fake_cuda_here()
    with pytest.raises(launch.FakeCudaUnavailable, match="built with CUDA but sees no GPU.*CPU build"):
        launch.fake_cuda_library()
    with caplog.at_level("WARNING", logger="hf_lowzero"):
        plan = plan_memory(tiny_model_spec("gpt2").config, world_size=2, device_memory="1GiB", seq_len=32)
    assert plan.simulated_on == "cpu"
    assert "planning GPU setups on fake CPU tensors" in caplog.text and "sees no GPU" in caplog.text
    assert plan.recommended is not None and plan.recommended.fits


def _cache_hub_config(hf_home, repo_id: str, config) -> None:
    """``repo_id``'s config.json in a Hugging Face cache at ``hf_home``, as ``hf download`` leaves it."""
    repo = hf_home / "hub" / f"models--{repo_id.replace('/', '--')}"
    revision = "0" * 40
    config.save_pretrained(repo / "snapshots" / revision)
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(revision)


def test_the_plan_takes_a_hub_id_from_the_cache_and_says_what_to_do_without_one(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # as on a machine without internet: the cache only
    import huggingface_hub.constants
    import transformers.utils.hub

    for module in (huggingface_hub.constants, transformers.utils.hub):
        for name in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "TRANSFORMERS_CACHE"):
            if hasattr(module, name):
                monkeypatch.setattr(module, name, str(tmp_path / "hub"))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    _cache_hub_config(tmp_path, "tiny-org/tiny-gpt2", tiny_model_spec("gpt2").config)
    argv = ["--world-size", "2", "--seq-len", "32", "--device-memory", "1GiB", "--backend", "gloo"]
    assert plan_main(["--model", "tiny-org/tiny-gpt2", *argv]) == 0
    assert "Memory plan: tiny-gpt2" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exited:
        plan_main(["--model", "meta-llama/Llama-3.1-8B", *argv])
    err = capsys.readouterr().err.strip().splitlines()
    assert exited.value.code == 2 and "Traceback" not in "\n".join(err)
    assert "meta-llama/Llama-3.1-8B is no local path" in err[-1]
    assert "pass a local directory or a config.json" in err[-1]


@pytest.mark.parametrize(
    "bad, message",
    [
        (dict(world_size=0), "world_size=0 is invalid"),
        (dict(device_memory="-3GiB"), "device_memory='-3GiB' is invalid"),
        (dict(seq_len=0), "seq_len=0 is invalid"),
        (dict(lora_r=0), "lora_r=0 is invalid"),
        (dict(backend="mpi"), "backend='mpi' is invalid"),
    ],
)
def test_plan_refuses_bad_input(bad, message):
    kwargs = dict(world_size=1, device_memory="1GiB", seq_len=16) | bad
    with pytest.raises(ValueError, match=message):
        plan_memory(tiny_model_spec("gpt2").config, **kwargs)


def test_parse_bytes():
    assert parse_bytes("80GiB") == 80 * 2**30
    assert parse_bytes("40 GB") == 40 * 10**9
    assert parse_bytes("1.5MiB") == 3 * 2**19
    assert parse_bytes(1024) == 1024
    with pytest.raises(ValueError, match="expected a positive size"):
        parse_bytes("lots")


class OomGpt2(GPT2LMHeadModel):
    """GPT-2 on a device where more than ``limit`` sequences run out of memory in backward (on
    real tensors; the plan's fake ones never do)."""

    limit = 3

    def forward(self, input_ids=None, labels=None, **kwargs):
        out = super().forward(input_ids=input_ids, labels=labels, **kwargs)
        if input_ids.shape[0] > self.limit and not isinstance(input_ids, FakeTensor):
            out.logits.register_hook(_oom)
            out.loss = out.loss + 0 * out.logits.sum()
        return out


def _oom(grad):
    raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB (injected in backward)")


def auto_args(out, memory, **kwargs):
    return LowZeroTrainingArguments(
        output_dir=str(out),
        zero_stage="auto",
        zero_device_memory=memory,
        use_cpu=True,
        report_to=[],
        max_steps=3,
        learning_rate=3e-3,
        logging_steps=1,
        save_strategy="no",
        **kwargs,
    )


@pytest.fixture
def trainer_process_group():
    """The Trainer makes a world of size 1 in this process; the plans of later tests need none."""
    yield
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def losses(trainer):
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


def test_auto_stage_takes_the_plan_and_trains_as_that_stage(trainer_process_group, tmp_path, caplog):
    dataset = TokenDataset()
    roomy = plan_memory(tiny_gpt2(), auto_args(tmp_path / "p", "1GiB"), device_memory="1GiB", seq_len=16)
    # fp32 at W=1: ZeRO holds masters besides the params, more than DDP; offloaded, less
    offloaded, ddp = roomy.row(2, True).peak_bytes, roomy.row(0).peak_bytes
    assert offloaded < ddp < roomy.row(2).peak_bytes
    memory = int((offloaded + ddp) / 2 / 0.9)  # only offload fits
    with caplog.at_level("WARNING", logger="hf_lowzero.trainer.auto"):
        auto = LowZeroTrainer(model=tiny_gpt2(), args=auto_args(tmp_path / "auto", memory), train_dataset=dataset)
    assert (auto.args.zero_stage, auto.args.zero_offload_optimizer) == (
        auto.memory_plan.recommended.stage,
        auto.memory_plan.recommended.offload,
    )
    assert "zero_stage=auto:" in caplog.text and auto.memory_plan.recommended.label in caplog.text
    assert auto.args.zero_offload_optimizer is True
    auto.train()
    chosen = auto.memory_plan.recommended
    explicit_args = auto_args(tmp_path / "explicit", None)
    explicit_args.zero_stage, explicit_args.zero_offload_optimizer = chosen.stage, chosen.offload or None
    explicit = LowZeroTrainer(model=tiny_gpt2(), args=explicit_args, train_dataset=dataset)
    explicit.train()
    assert losses(auto) == losses(explicit)


def test_auto_stage_plans_as_plan_memory_does(trainer_process_group, tmp_path):
    """One path decides for both ([Note: one plan for the Trainer and the user]): the Trainer's plan
    is ``plan_memory``'s for the same model, arguments and inputs, row for row. The Trainer used to
    plan gloo (its CPU device) where ``plan_memory`` planned NCCL on fake GPUs."""
    user = plan_memory(tiny_gpt2(), auto_args(tmp_path / "plan", "1GiB"), device_memory="1GiB", seq_len=16)
    auto = LowZeroTrainer(model=tiny_gpt2(), args=auto_args(tmp_path / "auto", "1GiB"), train_dataset=TokenDataset())
    assert user.simulated_on == auto.memory_plan.simulated_on == "cpu"  # use_cpu: CPU ranks (gloo)
    assert auto.memory_plan.rows == user.rows and auto.memory_plan.recommended == user.recommended
    chosen = (auto.args.zero_stage, bool(auto.args.zero_offload_optimizer))
    assert chosen == (user.recommended.stage, user.recommended.offload)


def _gpt2_64():
    """The issue's small GPT-2 for 64-token sequences (4.1M params)."""
    return tiny_gpt2(n_positions=64, n_embd=128, n_layer=4, n_head=4, vocab_size=26000)


def _auto_choice(rank: int, world_size: int, out: str, memory: int) -> None:
    """A rank of a CPU Trainer with zero_stage="auto"; rank 0 writes the choice it took."""
    args = auto_args(out, str(memory), per_device_train_batch_size=2)
    trainer = LowZeroTrainer(model=_gpt2_64(), args=args, train_dataset=TokenDataset(length=64))
    if rank == 0:
        chosen = [trainer.args.zero_stage, bool(trainer.args.zero_offload_optimizer)]
        (Path(out) / "chosen.json").write_text(json.dumps(chosen))


@pytest.mark.slow  # two ranks planning in a process of their own, and a plan on fake GPUs: about a minute
def test_auto_stage_of_two_cpu_ranks_takes_what_plan_memory_recommends(tmp_path):
    """The issue's case: 2 CPU ranks (gloo), a small GPT-2, 64 tokens, at a device memory where the
    plan for CPU ranks needs offload and the plan for GPUs does not (gloo's scratch pool keeps the
    collectives' buffers; at 120 MiB, stage 1 + offload against stage 1). The Trainer took the
    first and ``plan_memory`` on the same arguments recommended the second."""
    args = auto_args(tmp_path / "plan", None, per_device_train_batch_size=2)
    roomy = {b: plan_memory(_gpt2_64(), args, world_size=2, device_memory="1GiB", seq_len=64, backend=b)
             for b in ("nccl", "gloo")}  # fmt: skip
    gpu, cpu = roomy["nccl"].row(1).peak_bytes, roomy["gloo"].row(1).peak_bytes
    memory = int((gpu + cpu) / 2 / 0.9)  # stage 1 fits a GPU here, not a CPU rank
    assert gpu < 0.9 * memory < cpu and roomy["gloo"].row(1, offload=True).peak_bytes < 0.9 * memory
    run_distributed(_auto_choice, 2, out=str(tmp_path), memory=memory)
    chosen = tuple(json.loads((tmp_path / "chosen.json").read_text()))
    user = plan_memory(_gpt2_64(), args, world_size=2, device_memory=memory, seq_len=64).recommended
    assert chosen == (user.stage, user.offload) and user.offload  # CPU ranks: no setup fits without offload


def test_auto_stage_refuses_before_training_when_nothing_fits(trainer_process_group, tmp_path):
    with pytest.raises(ValueError, match="nothing fits"):
        LowZeroTrainer(model=tiny_gpt2(), args=auto_args(tmp_path / "none", "64KiB"), train_dataset=TokenDataset())
    assert not (tmp_path / "none").exists()


def test_auto_find_batch_size_starts_from_the_plans_batch(trainer_process_group, tmp_path, monkeypatch):
    # ``cpu``'s figures fixed: the fastest setup that fits is then the same on every machine
    monkeypatch.setenv(calibrate.CACHE_ENV, str(tmp_path / "cache"))
    calibrate.cache_path().parent.mkdir(parents=True)
    calibrate.cache_path().write_text(json.dumps(FIXED_CPU))
    model = OomGpt2(tiny_gpt2().config)
    args = auto_args(tmp_path / "oom", "1200KiB", auto_find_batch_size=True, per_device_train_batch_size=1)
    trainer = LowZeroTrainer(model=model, args=args, train_dataset=TokenDataset())
    start = trainer.memory_plan.recommended.max_batch_size
    assert start > OomGpt2.limit and trainer.args.per_device_train_batch_size == start
    trainer.train()
    # the Trainer's search (accelerate's find_executable_batch_size) shrank the batch after each OOM
    assert trainer._train_batch_size <= OomGpt2.limit < start
    assert len(losses(trainer)) == 3 and all(math.isfinite(v) for v in losses(trainer))


def test_auto_stage_flags():
    args = LowZeroTrainingArguments(output_dir=os.devnull, zero_stage="auto", use_cpu=True, report_to=[])
    assert args.zero_auto
    assert LowZeroTrainingArguments(output_dir=os.devnull, zero_stage="2", use_cpu=True).zero_stage == 2
    with pytest.raises(ValueError, match="zero_stage='three' is invalid"):
        LowZeroTrainingArguments(output_dir=os.devnull, zero_stage="three", use_cpu=True)
    with pytest.raises(ValueError, match="zero_device_memory='big' is invalid"):
        LowZeroTrainingArguments(output_dir=os.devnull, zero_stage="auto", zero_device_memory="big", use_cpu=True)


def test_plan_measures_on_the_device(monkeypatch):
    """Without zero_device_memory the plan takes the free memory: the GPU's, or a share of RAM."""
    from hf_lowzero.trainer.auto import free_device_memory

    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    free = free_device_memory(torch.device("cpu"))
    if not torch.cuda.is_available():
        with open("/proc/meminfo") as f:
            available = int(next(line for line in f if line.startswith("MemAvailable")).split()[1]) * 1024
        assert free == pytest.approx(available / 2, rel=0.05)
    assert free > 0


@pytest.mark.slow  # torchao compiles its step on first use: ~15 s each
@pytest.mark.parametrize("optim", ["adamw_torch_8bit", "adamw_torch_4bit"])
def test_probed_state_of_torchao_optimizers_equals_a_real_optimizers(optim):
    """torchao's low-bit AdamW runs compiled kernels that neither fake tensors nor the tracker take:
    the plan probes its state. It must equal the state a real optimizer holds after a step over the
    real model (block-wise scales, small tensors kept in fp32)."""
    spec = tiny_model_spec("gpt2")
    training = case_training(PlanCase(bf16=False, optim=optim))
    planned = simulate_step(spec, training, Setup(0), 1, 2, 16)
    model = spec.build(torch.float32)
    optimizer = training.optimizer_cls(model.parameters(), **training.optimizer_kwargs)
    model(**spec.batch(2, 16)).loss.backward()
    optimizer.step()
    real = storage_bytes(v for entry in optimizer.state.values() for v in entry.values() if torch.is_tensor(v))
    assert planned.breakdown["optimizer_state"] == real
    assert real < 4 * sum(p.numel() for p in model.parameters())  # low-bit: less than two fp32 states


def test_reference_model_is_frozen_weights_and_its_forward():
    spec = tiny_model_spec("gpt2")
    training = case_training(PlanCase(bf16=True))
    alone = simulate_step(spec, training, Setup(2), 2, 4, 64)
    with_reference = simulate_step(spec, training, Setup(2), 2, 4, 64, ref_model=True)
    weights = 2 * sum(p.numel() for p in spec.model_class(spec.config).parameters())  # bf16
    assert with_reference.breakdown["frozen"] - alone.breakdown["frozen"] == weights
    assert with_reference.peak >= alone.peak + weights
