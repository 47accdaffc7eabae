"""``with_zero`` on the trainers users already run: TRL's SFT, DPO (with a reference model) and GRPO
(a tiny model generating on CPU, a reward function), and transformers' Seq2SeqTrainer with
``predict_with_generate``. At W=2, stages 1 and 2 match the same trainer without ZeRO (per-step losses,
learning rates, final params; fp32), and the trained model unwraps as any accelerate-prepared model."""

import pytest
import torch

trl = pytest.importorskip("trl")

from transformers import (  # noqa: E402
    DataCollatorForSeq2Seq,
    HfArgumentParser,
    Seq2SeqTrainer,
    Seq2SeqTrainingArguments,
    TrainingArguments,
)
from trl import DPOConfig, DPOTrainer, GRPOConfig, GRPOTrainer, SFTConfig, SFTTrainer, TrlParser  # noqa: E402

from hf_lowzero import LowZeroTrainer, LowZeroTrainingArguments, with_zero  # noqa: E402
from hf_lowzero.testing import run_distributed  # noqa: E402
from tests.tiers import slow  # noqa: E402
from tests.trl_setup import (  # noqa: E402
    char_tokenizer,
    preference_dataset,
    prompt_dataset,
    seq2seq_dataset,
    sft_dataset,
    tiny_causal_lm,
    tiny_t5,
    vowel_reward,
)

STEPS = 4
COMMON = dict(
    use_cpu=True,
    bf16=False,  # TRL's configs default to bf16; compare fp32 here
    max_steps=STEPS,
    per_device_train_batch_size=4,
    gradient_accumulation_steps=2,  # stage 1 runs no_sync() on the first micro-batch
    learning_rate=3e-3,
    warmup_steps=1,
    max_grad_norm=1.0,
    logging_steps=1,
    save_strategy="no",
    report_to=[],
    disable_tqdm=True,
    seed=0,
)


def build(kind: str, stage: int, out: str):
    """The trainer of ``kind``: TRL's/transformers' own class for stage 0, its ZeRO twin otherwise."""
    tok = char_tokenizer()
    config_cls, trainer_cls, extra_args, extra = {
        "sft": (SFTConfig, SFTTrainer, {"max_length": 32}, {"train_dataset": sft_dataset()}),
        "dpo": (
            DPOConfig,
            DPOTrainer,
            {"max_length": 32},
            {"ref_model": tiny_causal_lm(tok), "train_dataset": preference_dataset()},
        ),
        "grpo": (
            GRPOConfig,
            GRPOTrainer,
            {"num_generations": 2, "max_completion_length": 8},
            {"reward_funcs": vowel_reward, "train_dataset": prompt_dataset()},
        ),
    }[kind]
    if stage:
        config_cls, trainer_cls, extra_args = (
            with_zero(config_cls),
            with_zero(trainer_cls),
            extra_args
            | {
                "zero_stage": stage,
                "zero_reduce_bucket_mb": 0.01,  # several buckets even for a tiny model
            },
        )
    args = config_cls(output_dir=f"{out}/{kind}{stage}", **COMMON, **extra_args)
    return trainer_cls(model=tiny_causal_lm(tok), args=args, processing_class=tok, **extra)


def logged(trainer, key: str) -> list[float]:
    return [h[key] for h in trainer.state.log_history if "loss" in h]


def compare(runs: dict, what: str) -> None:
    plain = runs[0]
    for stage in (1, 2):
        ours, where = runs[stage], f"{what} stage {stage}"
        assert ours["loss"] == pytest.approx(plain["loss"], rel=1e-5, abs=1e-7), where
        assert ours["learning_rate"] == plain["learning_rate"], where
        assert len(ours["params"]) == len(plain["params"])
        for p, q in zip(ours["params"], plain["params"]):
            torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-5, msg=lambda m, w=where: f"{w}: {m}")


def trl_body(rank, world_size, tmp, kind):
    runs = {}
    for stage in (0, 1, 2):
        trainer = build(kind, stage, tmp)
        trainer.train()
        model = trainer.model
        if stage:
            assert trainer.zero_optimizer is not None and trainer.zero_optimizer.world_size == world_size
            # The trained model is the model: TRL's unwrap_model_for_generation, PEFT and user code find it.
            assert trainer.accelerator.unwrap_model(trainer.model_wrapped) is model
            assert isinstance(model, torch.nn.Module) and not hasattr(model, "module")
        runs[stage] = {
            "loss": logged(trainer, "loss"),
            "learning_rate": logged(trainer, "learning_rate"),
            "params": [p.detach().clone() for p in model.parameters()],
        }
        if kind == "grpo":
            runs[stage]["reward"] = logged(trainer, "reward")
    assert len(runs[0]["loss"]) == STEPS
    compare(runs, kind)
    if kind == "grpo":  # the completions were sampled from the same weights on every step
        assert runs[1]["reward"] == pytest.approx(runs[0]["reward"]) == runs[2]["reward"]


@pytest.mark.parametrize("kind", ["sft", slow("dpo"), slow("grpo")])
def test_trl_trainer_with_zero_matches_it_without(tmp_path, kind):
    run_distributed(trl_body, 2, tmp=str(tmp_path), kind=kind)


def seq2seq_body(rank, world_size, tmp):
    tok = char_tokenizer()
    runs = {}
    for stage in (0, 1, 2):
        args_cls, trainer_cls = Seq2SeqTrainingArguments, Seq2SeqTrainer
        knobs = {}
        if stage:
            args_cls, trainer_cls = with_zero(args_cls), with_zero(trainer_cls)
            knobs = {"zero_stage": stage, "zero_reduce_bucket_mb": 0.01}
        args = args_cls(
            output_dir=f"{tmp}/s2s{stage}",
            predict_with_generate=True,
            generation_max_length=12,
            per_device_eval_batch_size=4,
            **COMMON,
            **knobs,
        )
        model = tiny_t5(tok)
        data = seq2seq_dataset(tok)
        trainer = trainer_cls(
            model=model,
            args=args,
            train_dataset=data,
            eval_dataset=data,
            data_collator=DataCollatorForSeq2Seq(tok, model=model),
            processing_class=tok,
        )
        trainer.train()
        prediction = trainer.predict(data)  # generates with the trained weights
        runs[stage] = {
            "loss": logged(trainer, "loss"),
            "learning_rate": logged(trainer, "learning_rate"),
            "params": [p.detach().clone() for p in model.parameters()],
            "generated": prediction.predictions.tolist(),
            "eval_loss": prediction.metrics["test_loss"],
        }
    compare(runs, "seq2seq")
    for stage in (1, 2):
        assert runs[stage]["generated"] == runs[0]["generated"], f"stage {stage}: other generated tokens"
        assert runs[stage]["eval_loss"] == pytest.approx(runs[0]["eval_loss"], rel=1e-5)


@pytest.mark.slow  # test tiers: the SFT parity run keeps a Trainer subclass in the fast tier
def test_seq2seq_trainer_with_zero_predicts_with_generate_like_without(tmp_path):
    run_distributed(seq2seq_body, 2, tmp=str(tmp_path))


def conversion_body(rank, world_size, tmp):
    # LowZeroTrainingArguments given to a TRL twin become its config's twin, every value kept (TRL
    # itself would rebuild them as SFTConfig and fail on zero_stage).
    tok = char_tokenizer()
    given = LowZeroTrainingArguments(output_dir=tmp, zero_stage=1, learning_rate=1e-4, use_cpu=True)
    trainer = with_zero(SFTTrainer)(tiny_causal_lm(tok), given, train_dataset=sft_dataset(), processing_class=tok)
    assert type(trainer.args) is with_zero(SFTConfig)
    assert (trainer.args.zero_stage, trainer.args.learning_rate) == (1, 1e-4)
    # GRPOTrainer takes its arguments third: found by name, not position.
    grpo_args = LowZeroTrainingArguments(output_dir=tmp, zero_stage=2, use_cpu=True, per_device_train_batch_size=8)
    model, data = tiny_causal_lm(tok), prompt_dataset()
    trainer = with_zero(GRPOTrainer)(model, vowel_reward, grpo_args, train_dataset=data, processing_class=tok)
    assert type(trainer.args) is with_zero(GRPOConfig) and trainer.args.zero_stage == 2
    with pytest.raises(TypeError, match=r"with_zero\(SFTConfig\)"):
        with_zero(SFTTrainer)(tiny_causal_lm(tok), SFTConfig(output_dir=tmp, use_cpu=True), processing_class=tok)


def test_zero_arguments_of_another_class_are_converted_and_plain_ones_refused(tmp_path):
    run_distributed(conversion_body, 1, tmp=str(tmp_path))


def test_with_zero_classes_parse_flags_keep_defaults_and_pickle(tmp_path):
    import pickle

    assert with_zero(TrainingArguments) is LowZeroTrainingArguments
    from transformers import Trainer

    assert with_zero(Trainer) is LowZeroTrainer
    assert with_zero(with_zero(SFTTrainer)) is with_zero(SFTTrainer)
    sft_config = with_zero(SFTConfig)
    assert issubclass(with_zero(SFTTrainer), SFTTrainer) and issubclass(with_zero(SFTTrainer), LowZeroTrainer)
    (args,) = TrlParser(sft_config).parse_args_and_config(
        ["--output_dir", str(tmp_path), "--use_cpu", "true", "--zero_stage", "2", "--zero_offload_optimizer", "true"]
    )
    assert type(args) is sft_config and args.zero_stage == 2 and args.zero_offload_optimizer is True
    plain = SFTConfig(output_dir=str(tmp_path), use_cpu=True)
    for name in ("learning_rate", "logging_steps", "bf16", "max_length", "gradient_checkpointing"):
        assert getattr(args, name) == getattr(plain, name), f"{name}: TRL's default lost"  # not TrainingArguments'
    (s2s,) = HfArgumentParser(with_zero(Seq2SeqTrainingArguments)).parse_args_into_dataclasses(
        ["--output_dir", str(tmp_path), "--zero_stage", "1", "--predict_with_generate", "true"]
    )
    assert s2s.zero_stage == 1 and s2s.predict_with_generate and s2s.to_zero_config().stage == 1
    # Trainer saves its arguments with torch.save; Ray pickles trainers for hyperparameter_search.
    assert pickle.loads(pickle.dumps(args)).zero_stage == 2
    assert pickle.loads(pickle.dumps(with_zero(DPOTrainer))) is with_zero(DPOTrainer)
    with pytest.raises(TypeError, match="Trainer or TrainingArguments subclass"):
        with_zero(dict)
