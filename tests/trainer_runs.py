"""Shared pieces of the Trainer tests: arguments, a training run, logged values."""

from hf_lowzero import LowZeroTrainer, LowZeroTrainingArguments
from tests.hf_models import TokenDataset

STEPS, ACCUMULATION = 6, 2


def make_args(out, stage, **overrides) -> LowZeroTrainingArguments:
    base = dict(
        output_dir=str(out),
        zero_stage=stage,
        use_cpu=True,
        per_device_train_batch_size=2,
        gradient_accumulation_steps=ACCUMULATION,
        max_steps=STEPS,
        learning_rate=3e-3,
        warmup_steps=2,
        max_grad_norm=1.0,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        seed=0,
        disable_tqdm=True,
        zero_reduce_bucket_mb=0.01,  # several buckets even for a tiny model
    )
    return LowZeroTrainingArguments(**(base | overrides))


def train(model, args, task="clm", resume=None, **kwargs):
    trainer = LowZeroTrainer(model=model, args=args, train_dataset=TokenDataset(task=task), **kwargs)
    trainer.train(resume_from_checkpoint=resume)
    return trainer


def logged(trainer, key):
    return [h[key] for h in trainer.state.log_history if "loss" in h]
