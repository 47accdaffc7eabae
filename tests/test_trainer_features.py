"""Features people switch on beside ZeRO, each against the plain Trainer (zero_stage=0, DDP) on the
same seed and data, in real 2-process gloo jobs: what works with Trainer works with zero_stage=1|2."""

import json
import os

import pytest
import torch
from torch import nn
from transformers import AutoModelForCausalLM
from transformers.trainer_utils import get_last_checkpoint

from hf_lowzero import LowZeroTrainer, LowZeroTrainingArguments, consolidate_checkpoint
from hf_lowzero.checkpoint.layout import EXTRAS_FILE, META_FILE, TRAINER_SUBDIR
from hf_lowzero.testing import run_distributed
from tests.hf_models import VOCAB, TokenDataset, tiny_gpt2
from tests.models import param_groups
from tests.trainer_runs import logged, make_args


def params_of(model):
    return {n: p.detach().float().clone() for n, p in model.named_parameters()}


def assert_same_run(ref, ours, where, ref_params=None, our_params=None):
    """Same losses, grad norms and learning rates logged, same final params (up to gloo's
    summation order, as in the parity tests)."""
    assert logged(ours, "loss") == pytest.approx(logged(ref, "loss"), rel=1e-5), where
    assert logged(ours, "grad_norm") == pytest.approx(logged(ref, "grad_norm"), rel=1e-4), where
    assert logged(ours, "learning_rate") == pytest.approx(logged(ref, "learning_rate"), rel=1e-6), where
    ref_params = ref_params or params_of(ref.model)
    our_params = our_params or params_of(ours.model)
    assert ref_params.keys() == our_params.keys(), where
    for n, p in our_params.items():
        torch.testing.assert_close(p, ref_params[n], rtol=1e-4, atol=1e-5, msg=lambda m, n=n: f"{where} {n}: {m}")


def read_meta(zero_dir):
    with open(os.path.join(zero_dir, META_FILE)) as f:
        return json.load(f)


# ------------------------------------------------------------------ models and data


class TiedWithSometimesHead(nn.Module):
    """GPT-2 (lm_head tied to the embedding) plus an auxiliary head used only for batches whose
    first token is even: on some ranks only, in some steps."""

    def __init__(self):
        super().__init__()
        self.lm = tiny_gpt2()
        self.aux = nn.Linear(32, 3)

    def forward(self, input_ids, labels):
        out = self.lm(input_ids=input_ids, labels=labels, output_hidden_states=True)
        loss = out.loss
        if int(input_ids[0, 0]) % 2 == 0:
            loss = loss + self.aux(out.hidden_states[-1]).pow(2).mean()
        return {"loss": loss}


class VarLengthDataset(torch.utils.data.Dataset):
    def __init__(self, n=64, seed=5):
        g = torch.Generator().manual_seed(seed)
        self.items = [
            torch.randint(0, VOCAB, (int(torch.randint(4, 17, (1,), generator=g)),), generator=g) for _ in range(n)
        ]

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        return {"input_ids": self.items[i], "labels": self.items[i]}


def pad_collator(features):
    width = max(len(f["input_ids"]) for f in features)
    ids = torch.zeros(len(features), width, dtype=torch.long)
    labels = torch.full((len(features), width), -100)
    mask = torch.zeros(len(features), width, dtype=torch.long)
    for i, f in enumerate(features):
        n = len(f["input_ids"])
        ids[i, :n], labels[i, :n], mask[i, :n] = f["input_ids"], f["labels"], 1
    return {"input_ids": ids, "labels": labels, "attention_mask": mask}


def custom_optimizers(model):
    inner = torch.optim.AdamW(param_groups(model, lr=3e-3), betas=(0.9, 0.95))
    return inner, torch.optim.lr_scheduler.LambdaLR(inner, lambda s: 1.0 / (1 + s))


# A case: name, stage, model builder, TrainingArguments overrides, extra LowZeroTrainer kwargs.
CASES = [
    ("adamw_torch_fused+cosine", 1, tiny_gpt2, {"optim": "adamw_torch_fused", "lr_scheduler_type": "cosine"}, {}),
    ("adamw_torch_fused+cosine", 2, tiny_gpt2, {"optim": "adamw_torch_fused", "lr_scheduler_type": "cosine"}, {}),
    ("sgd", 2, tiny_gpt2, {"optim": "sgd"}, {}),
    ("checkpointing non-reentrant", 2, tiny_gpt2, {"activation_checkpointing": True}, {}),
    (
        "checkpointing reentrant",
        1,
        tiny_gpt2,
        {"activation_checkpointing": True, "activation_checkpointing_kwargs": {"use_reentrant": True}},
        {},
    ),
    (
        "checkpointing reentrant",
        2,
        tiny_gpt2,
        {"activation_checkpointing": True, "activation_checkpointing_kwargs": {"use_reentrant": True}},
        {},
    ),
    ("neftune", 2, tiny_gpt2, {"neftune_noise_alpha": 5.0}, {}),
    (
        "group_by_length",
        2,
        tiny_gpt2,
        {"train_sampling_strategy": "group_by_length"},
        {"train_dataset": VarLengthDataset(), "data_collator": pad_collator},
    ),
    (
        "optimizer_cls_and_kwargs",
        2,
        tiny_gpt2,
        {},
        {"optimizer_cls_and_kwargs": (torch.optim.SGD, {"lr": 0.05, "momentum": 0.9})},
    ),
    ("optimizers=(AdamW, LambdaLR)", 2, tiny_gpt2, {}, {"optimizers": custom_optimizers}),
    ("tied weights, head on some ranks", 2, TiedWithSometimesHead, {"ddp_find_unused_parameters": True}, {}),
    ("torch_compile", 2, tiny_gpt2, {"torch_compile": True, "torch_compile_backend": "aot_eager"}, {}),
]


def run_case(tmp, name, stage, build, overrides, extra):
    trainers = {}
    for s in (0, stage):
        model = build()
        kwargs = dict(extra)
        if "optimizers" in kwargs:
            kwargs["optimizers"] = kwargs["optimizers"](model)
        kwargs.setdefault("train_dataset", TokenDataset())
        args = make_args(f"{tmp}/{name}-{s}", s, **overrides)
        trainers[s] = LowZeroTrainer(model=model, args=args, **kwargs)
        trainers[s].train()
    return trainers[0], trainers[stage]


def features_body(rank, world_size, tmp):
    for name, stage, build, overrides, extra in CASES:
        where = f"{name} (stage {stage})"
        ref, ours = run_case(tmp, name, stage, build, overrides, extra)
        assert_same_run(ref, ours, where)
        group, ref_group = (
            ours.get_optimizer_group(next(ours.model.parameters())),
            ref.get_optimizer_group(next(ref.model.parameters())),
        )
        assert (group["lr"], group["weight_decay"]) == (ref_group["lr"], ref_group["weight_decay"]), where
        if name == "torch_compile":
            assert ours.model_wrapped is not ours.model, "torch_compile=True must compile the model"
            assert type(ours.model_wrapped).__name__ == "OptimizedModule"
            assert ours.accelerator.unwrap_model(ours.model_wrapped, keep_torch_compile=False) is ours.model
        if name.startswith("optimizers="):
            sd = ours.optimizer.state_dict()
            assert set(sd) >= {"state", "param_groups"} and all(isinstance(k, int) for k in sd["state"])
            assert ours.lr_scheduler.get_last_lr() == ref.lr_scheduler.get_last_lr()


@pytest.mark.slow  # test tiers (tests/tiers.py): long; shorter tests of this area stay fast
def test_features_match_plain_trainer(tmp_path):
    run_distributed(features_body, 2, tmp=str(tmp_path))


# ------------------------------------------------------------- new models, search


def model_init():
    return tiny_gpt2(seed=3)


def search_body(rank, world_size, tmp):
    results = {}
    for stage in (0, 2):
        args = make_args(f"{tmp}/init-{stage}", stage, eval_strategy="no")
        trainer = LowZeroTrainer(
            model_init=model_init, args=args, train_dataset=TokenDataset(), eval_dataset=TokenDataset(n=8, seed=9)
        )
        trainer.train()
        first = logged(trainer, "loss")
        first_opt = trainer.zero_optimizer
        trainer.train()  # a fresh model and optimizer, the same run again
        assert logged(trainer, "loss") == pytest.approx(first, rel=1e-6)
        if stage:
            assert trainer.zero_optimizer is not first_opt and trainer.zero_optimizer.model is trainer.model
        best = trainer.hyperparameter_search(
            hp_space=lambda trial: {"learning_rate": trial.suggest_float("learning_rate", 1e-3, 1e-2, log=True)},
            backend="optuna",
            n_trials=2,
            direction="minimize",
            sampler=__import__("optuna").samplers.TPESampler(seed=0),
        )
        results[stage] = (first, best)
    (ref_losses, ref_best), (losses, best) = results[0], results[2]
    assert losses == pytest.approx(ref_losses, rel=1e-5)
    if rank != 0:
        return  # only rank 0 runs the study; the others follow its trials
    assert best.hyperparameters == ref_best.hyperparameters
    assert best.objective == pytest.approx(ref_best.objective, rel=1e-5)


@pytest.mark.slow  # test tiers (tests/tiers.py): long; shorter tests of this area stay fast
def test_model_init_and_optuna_search_rebuild_the_optimizer(tmp_path):
    run_distributed(search_body, 2, tmp=str(tmp_path))


# ------------------------------------------------- checkpoints, evaluation, OOM retry


class OomAbove(nn.Module):
    """GPT-2 whose backward raises a CUDA-style OOM when a micro-batch has more than ``limit``
    sequences, as a real out-of-memory in a layer's backward would."""

    def __init__(self, limit=2):
        super().__init__()
        self.lm = tiny_gpt2()
        self.limit = limit

    def forward(self, input_ids, labels):
        out = self.lm(input_ids=input_ids, labels=labels)
        if input_ids.shape[0] > self.limit:
            out.logits.register_hook(self._oom)
            return {"loss": out.loss + 0 * out.logits.sum()}
        return {"loss": out.loss}

    @staticmethod
    def _oom(grad):
        raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB (injected in backward)")


def only_model_resume(tmp, stage):
    args = make_args(f"{tmp}/only-model-{stage}", stage, save_strategy="steps", save_steps=3, save_only_model=True)
    LowZeroTrainer(model=tiny_gpt2(), args=args, train_dataset=TokenDataset()).train()
    assert not os.path.exists(f"{tmp}/only-model-{stage}/checkpoint-3/{TRAINER_SUBDIR}")
    resumed = LowZeroTrainer(model=tiny_gpt2(seed=4), args=args, train_dataset=TokenDataset())
    resumed.train(resume_from_checkpoint=f"{tmp}/only-model-{stage}/checkpoint-3")
    return resumed


def best_model_run(tmp, stage):
    args = make_args(
        f"{tmp}/best-{stage}",
        stage,
        max_steps=8,
        eval_strategy="steps",
        eval_steps=2,
        save_strategy="steps",
        save_steps=2,
        save_total_limit=1,
        load_best_model_at_end=True,
        metric_for_best_model="eval_loss",
    )
    trainer = LowZeroTrainer(
        model=tiny_gpt2(), args=args, train_dataset=TokenDataset(), eval_dataset=TokenDataset(n=8, seed=3)
    )
    trainer.train()
    return trainer


def oom_retry_run(tmp, stage):
    args = make_args(f"{tmp}/oom-{stage}", stage, per_device_train_batch_size=4, auto_find_batch_size=True)
    trainer = LowZeroTrainer(model=OomAbove(limit=2), args=args, train_dataset=TokenDataset())
    trainer.train()
    assert trainer._train_batch_size == 2  # halved once, then finished
    return trainer


def compiled_checkpoint_body(rank, world_size, tmp):
    """Checkpoint names are the uncompiled ones: resume compiled <-> uncompiled, from_pretrained."""
    args = make_args(f"{tmp}/compiled", 2, save_strategy="steps", save_steps=3, remove_unused_columns=False)
    compiled = torch.compile(tiny_gpt2(), backend="eager")
    uninterrupted = LowZeroTrainer(model=compiled, args=args, train_dataset=TokenDataset())
    uninterrupted.train()
    meta = read_meta(f"{tmp}/compiled/checkpoint-3/{TRAINER_SUBDIR}")
    assert not any("_orig_mod" in n for n in meta["params"]) and "transformer.wte.weight" in meta["params"]
    final = {k.replace("_orig_mod.", ""): v for k, v in params_of(compiled).items()}
    if rank == 0:
        reloaded = AutoModelForCausalLM.from_pretrained(f"{tmp}/compiled/checkpoint-3")
        saved = consolidate_checkpoint(f"{tmp}/compiled/checkpoint-3/{TRAINER_SUBDIR}")
        for n, p in reloaded.named_parameters():
            assert torch.equal(p, saved[n]), f"from_pretrained of a compiled run's checkpoint: {n}"
    for model in (tiny_gpt2(seed=8), torch.compile(tiny_gpt2(seed=8), backend="eager")):
        resumed = LowZeroTrainer(model=model, args=args, train_dataset=TokenDataset())
        resumed.train(resume_from_checkpoint=f"{tmp}/compiled/checkpoint-3")
        for n, p in params_of(model).items():
            torch.testing.assert_close(
                p, final[n.replace("_orig_mod.", "")], rtol=0, atol=0, msg=lambda m, n=n: f"resume {n}: {m}"
            )


def checkpoints_body(rank, world_size, tmp):
    for stage in (1, 2):
        ref, ours = only_model_resume(tmp, 0), only_model_resume(tmp, stage)
        assert_same_run(ref, ours, f"save_only_model resume, stage {stage}")

        ref, ours = best_model_run(tmp, 0), best_model_run(tmp, stage)
        assert_same_run(ref, ours, f"load_best_model_at_end, stage {stage}")
        evals = [[h["eval_loss"] for h in t.state.log_history if "eval_loss" in h] for t in (ref, ours)]
        assert evals[1] == pytest.approx(evals[0], rel=1e-5)
        assert os.path.basename(ours.state.best_model_checkpoint) == os.path.basename(ref.state.best_model_checkpoint)
        kept = [sorted(d for d in os.listdir(t.args.output_dir) if d.startswith("checkpoint-")) for t in (ref, ours)]
        assert kept[1] == kept[0] and len(kept[0]) <= 2  # rotation kept the best and the last
        assert os.path.basename(get_last_checkpoint(ours.args.output_dir)) == kept[0][-1]

        ref, ours = oom_retry_run(tmp, 0), oom_retry_run(tmp, stage)
        assert_same_run(ref, ours, f"auto_find_batch_size after an OOM in backward, stage {stage}")
    compiled_checkpoint_body(rank, world_size, tmp)


@pytest.mark.slow  # test tiers (tests/tiers.py): long; shorter tests of this area stay fast
def test_checkpoints_evaluation_and_oom_retry_match_plain_trainer(tmp_path):
    run_distributed(checkpoints_body, 2, tmp=str(tmp_path))


# ------------------------------------------------------------------------- PEFT / LoRA


def lora_model(seed=0):
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=4, lora_alpha=8, target_modules=["c_attn"], lora_dropout=0.0, fan_in_fan_out=True)
    return get_peft_model(tiny_gpt2(seed=seed), config)


def safetensors_data_bytes(path: str) -> int:
    """A safetensors file's size less its 8-byte length prefix and JSON header."""
    with open(path, "rb") as f:
        header = int.from_bytes(f.read(8), "little")
    return os.path.getsize(path) - 8 - header


def lora_body(rank, world_size, tmp):
    from peft import PeftModel

    runs = {}
    for stage in (0, 2):
        model = lora_model()
        args = make_args(f"{tmp}/lora-{stage}", stage, save_strategy="steps", save_steps=3)
        runs[stage] = LowZeroTrainer(model=model, args=args, train_dataset=TokenDataset())
        runs[stage].train()
    ref, ours = runs[0], runs[2]
    assert_same_run(ref, ours, "LoRA")

    zero_dir = f"{tmp}/lora-2/checkpoint-3/{TRAINER_SUBDIR}"
    meta = read_meta(zero_dir)
    trainable = {n for n, p in ours.model.named_parameters() if p.requires_grad}
    assert set(meta["params"]) == trainable and all("lora_" in n for n in trainable)
    assert not os.path.exists(f"{zero_dir}/{EXTRAS_FILE}"), "the frozen base belongs to the base model, not the shards"
    # The tensors the shards hold (file headers with their per-tensor checksums aside): far below the frozen base.
    shard_files = [f"{zero_dir}/{f}" for f in os.listdir(zero_dir) if f.endswith(".safetensors")]
    shard_bytes = sum(safetensors_data_bytes(f) for f in shard_files)
    base_bytes = sum(p.numel() * 4 for p in ours.model.parameters() if not p.requires_grad)
    assert shard_bytes < base_bytes / 5, (shard_bytes, base_bytes)

    # Resume equals the uninterrupted run: the base model is rebuilt (as for plain Trainer, whose
    # checkpoint holds the adapter only); the adapter and optimizer state come from the checkpoint.
    model = lora_model(seed=0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.5) if p.requires_grad else None
    resumed = LowZeroTrainer(model=model, args=ours.args, train_dataset=TokenDataset())
    resumed.train(resume_from_checkpoint=f"{tmp}/lora-2/checkpoint-3")
    for n, p in params_of(resumed.model).items():
        torch.testing.assert_close(
            p, params_of(ours.model)[n], rtol=0, atol=0, msg=lambda m, n=n: f"LoRA resume {n}: {m}"
        )

    if rank == 0:
        # Consolidation needs the base model for the frozen weights, and then gives the full model.
        with pytest.raises(ValueError, match="Pass base="):
            consolidate_checkpoint(f"{tmp}/lora-2/checkpoint-{ours.state.global_step}/{TRAINER_SUBDIR}")
        ours.save_model(f"{tmp}/lora-final")
        full = consolidate_checkpoint(f"{tmp}/lora-2/checkpoint-6/{TRAINER_SUBDIR}", base=lora_model(seed=0))
        fresh = lora_model(seed=0)
        fresh.load_state_dict(full, strict=True)
        reloaded = PeftModel.from_pretrained(tiny_gpt2(seed=0), f"{tmp}/lora-final")  # adapter-only save
        for (n, p), q, r in zip(fresh.named_parameters(), reloaded.parameters(), ours.model.parameters()):
            assert torch.equal(p, r) and torch.equal(q, r), n


def test_lora_checkpoints_hold_only_trainable_state(tmp_path):
    run_distributed(lora_body, 2, tmp=str(tmp_path))


# ----------------------------------------------------------------- conflicting flags


@pytest.mark.parametrize(
    "overrides,kwargs,message",
    [
        ({"optim": "adafactor", "zero_partition": "rows"}, {}, "--optim adafactor.*partition='params'"),
        ({"zero_partition": "rows"}, {"optimizer_cls_and_kwargs": (torch.optim.Adafactor, {})}, "whole tensor"),
        ({}, {"optimizer_cls_and_kwargs": (torch.optim.LBFGS, {})}, "LBFGS cannot run under ZeRO"),
        ({}, {"optimizer_cls_and_kwargs": (torch.optim.SparseAdam, {})}, "SparseAdam cannot run under ZeRO"),
    ],
)
def test_conflicting_flags_fail_at_construction(tmp_path, overrides, kwargs, message):
    args = LowZeroTrainingArguments(output_dir=str(tmp_path), zero_stage=2, report_to=[], use_cpu=True, **overrides)
    with pytest.raises(ValueError, match=message):
        LowZeroTrainer(model=tiny_gpt2(), args=args, train_dataset=TokenDataset(), **kwargs)
