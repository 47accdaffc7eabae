"""LowZeroTrainer against the plain Trainer (DDP), in real 2-process gloo jobs on CPU."""

import json
import os
import warnings
from pathlib import Path

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel
from transformers import AutoModelForCausalLM, HfArgumentParser, TrainerCallback, TrainingArguments

from hf_lowzero import LowZeroTrainer, LowZeroTrainingArguments, consolidate_checkpoint
from hf_lowzero.testing import run_distributed
from hf_lowzero.zero.runtime.comm import comm_stats
from tests.hf_models import TokenDataset, tiny_bert, tiny_gpt2
from tests.trainer_runs import ACCUMULATION, STEPS, logged, make_args, train


def parity_body(rank, world_size, tmp):
    for name, build, task in [("gpt2", tiny_gpt2, "clm"), ("bert", tiny_bert, "cls")]:
        runs = {}
        for stage in (0, 1, 2):
            comm_stats.reset()
            model = build()
            trainer = train(model, make_args(f"{tmp}/{name}{stage}", stage), task)
            runs[stage] = trainer, [p.detach().clone() for p in model.parameters()]
            if stage == 0:
                assert isinstance(trainer.model_wrapped, DistributedDataParallel)
                continue
            assert trainer.model_wrapped is model  # no DDP, no wrapper under ZeRO ([Note: no wrapper])
            n_buckets = len(trainer.zero_optimizer.buckets)
            assert n_buckets > 1
            # Stage 1: no_sync() on the non-final micro-batch, one reduce-scatter per bucket per step;
            # stage 2: every micro-batch is reduce-scattered. One all-reduce per step: norm and usage.
            micro_batches_reduced = 1 if stage == 1 else ACCUMULATION
            assert comm_stats.calls["reduce_scatter"] == STEPS * micro_batches_reduced * n_buckets
            assert comm_stats.calls["all_reduce"] == STEPS
        ddp, ddp_params = runs[0]
        for stage in (1, 2):
            trainer, params = runs[stage]
            where = f"{name} stage {stage}"
            assert logged(trainer, "loss") == pytest.approx(logged(ddp, "loss"), rel=1e-5), where
            assert logged(trainer, "grad_norm") == pytest.approx(logged(ddp, "grad_norm"), rel=1e-4), where
            assert logged(trainer, "learning_rate") == logged(ddp, "learning_rate"), where
            assert logged(trainer, "skipped_steps") == [0] * STEPS and logged(trainer, "loss_scale") == [1.0] * STEPS
            for p, q in zip(params, ddp_params):
                torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-5, msg=lambda m, w=where: f"{w}: {m}")


def test_fp32_zero_matches_plain_trainer(tmp_path):
    run_distributed(parity_body, 2, tmp=str(tmp_path))


class ParamsAtStart(TrainerCallback):
    def on_train_begin(self, args, state, control, model=None, **kwargs):
        self.params = {n: p.detach().clone() for n, p in model.named_parameters()}


def mixed_precision_body(rank, world_size, tmp):
    fp32 = train(tiny_gpt2(), make_args(f"{tmp}/fp32", 2))
    # fp16 starts at 2**24 so that the first steps overflow (HF computes the loss in fp32, so
    # the default 2**16 does not) and the skip path runs inside the Trainer.
    fp16_knobs = {"fp16": True, "zero_config": json.dumps({"initial_scale": 2.0**24})}
    for flag, dtype, stage, knobs in [
        ("bf16", torch.bfloat16, 2, {"bf16": True}),
        ("fp16", torch.float16, 1, fp16_knobs),
    ]:
        model = tiny_gpt2()
        args = make_args(f"{tmp}/{flag}", stage, save_strategy="steps", save_steps=3, **knobs)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            trainer = train(model, args)
        assert not [w for w in caught if "lr_scheduler.step()" in str(w.message)], "scheduler stepped before optimizer"
        opt = trainer.zero_optimizer
        assert all(p.dtype is dtype for p in model.parameters()), "16-bit params, not autocast"
        assert opt.master.flat.dtype is torch.float32
        scales, skipped = logged(trainer, "loss_scale"), logged(trainer, "skipped_steps")
        if flag == "fp16":
            assert skipped[-1] >= 2 and scales[-1] < 2.0**24, (skipped, scales)  # skipped, backed off
        else:
            assert scales == [1.0] * STEPS and skipped == [0] * STEPS
            losses, ref = logged(trainer, "loss"), logged(fp32, "loss")
            assert losses == pytest.approx(ref, rel=2e-2)  # tracks the fp32 curve
        # A skipped step does not advance the LR schedule.
        assert trainer.lr_scheduler.last_epoch == trainer.state.global_step - opt.skipped_steps

        # Resume from checkpoint-3: continues like the uninterrupted run, scaler state included.
        watch = ParamsAtStart()
        resumed = LowZeroTrainer(model=tiny_gpt2(seed=5), args=args, train_dataset=TokenDataset(), callbacks=[watch])
        resumed.train(resume_from_checkpoint=f"{tmp}/{flag}/checkpoint-3")
        saved = consolidate_checkpoint(f"{tmp}/{flag}/checkpoint-3/zero_optimizer")
        for n, p in watch.params.items():
            assert torch.equal(p, saved[n].to(dtype)), n
        assert resumed.zero_optimizer.loss_scale == opt.loss_scale
        assert resumed.zero_optimizer.skipped_steps == opt.skipped_steps
        for p, q in zip(resumed.model.parameters(), model.parameters()):
            torch.testing.assert_close(p, q, rtol=0, atol=0)


def test_bf16_and_fp16_use_16bit_params_with_fp32_master_rows(tmp_path):
    run_distributed(mixed_precision_body, 2, tmp=str(tmp_path))


def resume_body(rank, world_size, tmp, phase):
    out = f"{tmp}/run"
    if phase == "uninterrupted":
        model = tiny_gpt2()
        trainer = train(model, make_args(out, 2, save_strategy="steps", save_steps=3))
        ckpt = Path(out) / "checkpoint-3"
        zero_files = sorted(os.listdir(ckpt / "zero_optimizer"))
        assert "zero_shard_rank00000_of_00002.safetensors" in zero_files
        assert "zero_shard_rank00001_of_00002.safetensors" in zero_files
        assert not (ckpt / "optimizer.pt").exists()
        trainer.save_model(f"{tmp}/final")
        if rank == 0:
            torch.save({n: p.detach() for n, p in model.named_parameters()}, f"{tmp}/final.pt")
            reloaded = AutoModelForCausalLM.from_pretrained(f"{tmp}/final")
            for (n, p), q in zip(model.named_parameters(), reloaded.parameters()):
                assert torch.equal(p, q), f"from_pretrained: {n}"
        return
    # Resume at a different world size (phase "resharded"), same global batch per step.
    watch = ParamsAtStart()
    per_device = 2 * 2 // world_size
    args = make_args(out + "-resumed", 2, per_device_train_batch_size=per_device, save_strategy="no")
    trainer = LowZeroTrainer(model=tiny_gpt2(seed=9), args=args, train_dataset=TokenDataset(), callbacks=[watch])
    trainer.train(resume_from_checkpoint=f"{out}/checkpoint-3")
    saved = consolidate_checkpoint(f"{out}/checkpoint-3/zero_optimizer")
    for n, p in watch.params.items():
        assert torch.equal(p, saved[n]), f"resumed params must be the checkpoint's: {n}"
    assert trainer.state.global_step == STEPS
    assert all(torch.isfinite(torch.tensor(logged(trainer, "loss"))))


@pytest.mark.slow  # test tiers (tests/tiers.py): long; shorter tests of this area stay fast
def test_checkpoints_hold_every_shard_and_resume_at_another_world_size(tmp_path):
    run_distributed(resume_body, 2, tmp=str(tmp_path), phase="uninterrupted")
    run_distributed(resume_body, 1, tmp=str(tmp_path), phase="resharded")


def test_arguments_parse_as_cli_flags_and_validate(tmp_path):
    parser = HfArgumentParser(LowZeroTrainingArguments)
    (args,) = parser.parse_args_into_dataclasses(
        [
            "--output_dir",
            str(tmp_path),
            "--zero_stage",
            "1",
            "--zero_reduce_bucket_mb",
            "4",
            "--max_grad_norm",
            "0.5",
            "--zero_offload_optimizer",
            "true",
            "--zero_config",
            json.dumps({"hysteresis": 1, "initial_scale": 1024}),
        ]
    )
    cfg = args.to_zero_config()
    knobs = (
        cfg.stage,
        cfg.reduce_bucket_mb,
        cfg.clip_grad_norm,
        cfg.offload_optimizer,
        cfg.hysteresis,
        cfg.initial_scale,
    )
    assert knobs == (1, 4, 0.5, True, 1, 1024)
    with pytest.raises(ValueError, match="zero_stage=3 is invalid"):
        LowZeroTrainingArguments(output_dir=str(tmp_path), zero_stage=3)
    with pytest.raises(ValueError, match="unknown field"):
        LowZeroTrainingArguments(output_dir=str(tmp_path), zero_stage=2, zero_config='{"stagee": 2}')
    with pytest.raises(ValueError, match="reduce_bucket_mb"):
        LowZeroTrainingArguments(output_dir=str(tmp_path), zero_stage=2, zero_reduce_bucket_mb=-1)
    with pytest.raises(TypeError, match="LowZeroTrainingArguments"):
        LowZeroTrainer(model=tiny_gpt2(), args=TrainingArguments(output_dir=str(tmp_path), report_to=[]))
