"""A plan's check: the same step on real tensors, in ``world_size`` real processes (gloo on CPU).

Each rank runs ``simulate_step(..., fake=False)``: the model, optimizer, DDP or ZeRO and the
tracker of the plan, on real tensors and a real process group. The busiest rank's figures come
back. Tests and ``benchmarks/memory_plan.py`` compare them with the plan's.

Example::

    measured = measure_step(spec, training, Setup(stage=2), world_size=2, batch_size=4, seq_len=64)
    measured.peak, measured.model_states
"""

from __future__ import annotations

import dataclasses
import json
import os
import tempfile
from dataclasses import dataclass

import torch

from hf_lowzero.plan.models import ModelSpec
from hf_lowzero.plan.simulate import simulate_step
from hf_lowzero.plan.step_records import Setup, StepMemory, TrainingSpec
from hf_lowzero.testing import run_distributed
from hf_lowzero.zero.zero_config import ZeroConfig


def measure_step(
    spec: ModelSpec,
    training: TrainingSpec,
    setup: Setup,
    world_size: int,
    batch_size: int,
    seq_len: int,
    ref_model: bool = False,
) -> StepMemory:
    """One real step of ``setup`` on ``world_size`` local ranks; the rank with the highest peak."""
    with tempfile.TemporaryDirectory() as out:
        run_distributed(
            _measure_rank,
            world_size,
            spec=spec,
            training=training,
            setup=setup,
            batch_size=batch_size,
            seq_len=seq_len,
            ref_model=ref_model,
            out=out,
        )
        steps = []
        for rank in range(world_size):
            with open(os.path.join(out, f"rank{rank}.json")) as f:
                steps.append(StepMemory(**json.load(f)))
    return max(steps, key=lambda s: s.peak)


def _measure_rank(rank: int, world_size: int, spec, training, setup, batch_size, seq_len, ref_model, out) -> None:
    torch.manual_seed(0)
    step = simulate_step(spec, training, setup, world_size, batch_size, seq_len, fake=False, ref_model=ref_model)
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(dataclasses.asdict(step), f)


@dataclass(frozen=True)
class PlanCase:
    """One check of the plan: a tiny model from ``tiny_model_spec``, Trainer arguments, a setup and a
    world size. ``check_case`` simulates it as the plan does and measures it for real."""

    model: str = "gpt2"  # "gpt2", "bert", "t5" or "gpt2-lora"
    optim: str = "adamw_torch"
    bf16: bool = True
    gradient_checkpointing: bool = False
    world_size: int = 2
    stage: int = 2
    offload: bool = False
    gradient_accumulation_steps: int = 1
    batch_size: int = 4
    seq_len: int = 64
    master_dtype: str = "fp32"

    @property
    def label(self) -> str:
        parts = [self.model, self.optim, "bf16" if self.bf16 else "fp32", f"W={self.world_size}"]
        parts.append(Setup(self.stage, self.offload).label)
        if self.gradient_checkpointing:
            parts.append("checkpointing")
        if self.gradient_accumulation_steps > 1:
            parts.append(f"accumulation {self.gradient_accumulation_steps}")
        if self.master_dtype != "fp32":
            parts.append(f"{self.master_dtype} masters")
        return ", ".join(parts)


def tiny_model_spec(name: str) -> ModelSpec:
    """Small configs of the model families the plan is checked on (built, never downloaded)."""
    from transformers import BertConfig, GPT2Config, T5Config

    no_dropout = {"resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0}
    if name in ("gpt2", "gpt2-lora"):
        config = GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=1000, n_positions=128, **no_dropout)
        config.architectures = ["GPT2LMHeadModel"]
        return ModelSpec.from_source(config, lora_r=8 if name == "gpt2-lora" else None)
    if name == "bert":
        config = BertConfig(
            vocab_size=1000,
            hidden_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            intermediate_size=128,
            max_position_embeddings=128,
            hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0,
            architectures=["BertForMaskedLM"],
        )
        return ModelSpec.from_source(config)
    if name == "t5":
        config = T5Config(vocab_size=1000, d_model=64, d_kv=16, d_ff=128, num_layers=2, num_heads=4, dropout_rate=0.0)
        config.architectures = ["T5ForConditionalGeneration"]
        config.decoder_start_token_id = config.pad_token_id = 0
        return ModelSpec.from_source(config)
    raise ValueError(f"unknown tiny model {name!r}; expected gpt2, gpt2-lora, bert or t5")


def case_training(case: PlanCase) -> TrainingSpec:
    from transformers import TrainingArguments

    args = TrainingArguments(
        output_dir=os.devnull,
        report_to=[],
        use_cpu=True,
        bf16=case.bf16,
        optim=case.optim,
        gradient_checkpointing=case.gradient_checkpointing,
        gradient_accumulation_steps=case.gradient_accumulation_steps,
        per_device_train_batch_size=case.batch_size,
    )
    # The ZeRO fields LowZeroTrainingArguments(zero_master_dtype=...) would give, without reaching up
    # into trainer/ (the Trainer plans through this room, not the other way round).
    zero = ZeroConfig(stage=2, master_dtype=case.master_dtype, clip_grad_norm=float(args.max_grad_norm or 0.0))
    return TrainingSpec.from_args(args, zero_config=zero)


def check_case(case: PlanCase) -> dict:
    """The plan's figures for ``case`` (simulated as ``plan_memory`` does, for gloo on CPU) next to a
    real step's (``measure_step``): peak and model states, each with its ratio."""
    spec, training = tiny_model_spec(case.model), case_training(case)
    setup = Setup(case.stage, case.offload)
    planned = simulate_step(spec, training, setup, case.world_size, case.batch_size, case.seq_len, backend="gloo")
    if planned.owned_numel:  # the busiest rank, as the plan takes it
        busiest = max(range(case.world_size), key=lambda r: planned.owned_numel[r])
        planned = simulate_step(
            spec, training, setup, case.world_size, case.batch_size, case.seq_len, rank=busiest, backend="gloo"
        )
    measured = measure_step(spec, training, setup, case.world_size, case.batch_size, case.seq_len)
    return {
        "case": case.label,
        "planned_peak": planned.peak,
        "measured_peak": measured.peak,
        "peak_ratio": planned.peak / measured.peak,
        "planned_model_states": planned.model_states,
        "measured_model_states": measured.model_states,
        "model_states_ratio": planned.model_states / measured.model_states,
        "planned_sent": planned.sent_bytes,
        "measured_sent": measured.sent_bytes,
        "planned": dataclasses.asdict(planned),
        "measured": dataclasses.asdict(measured),
    }
