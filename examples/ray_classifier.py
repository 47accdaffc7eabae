"""Your own model and data on Ray Train with ZeRO: a BERT-style classifier, fault tolerant.

    python examples/ray_classifier.py                               # embedded local Ray, 2 CPU workers
    python examples/ray_classifier.py --inject-failure-at-step 12   # kill a worker once, watch it resume
    RAY_ADDRESS=auto python examples/ray_classifier.py --use-gpu --num-workers 8 --storage-path s3://bucket/runs

``train_func`` is what every worker of a ``TorchTrainer`` runs: build the model, data and
``LowZeroTrainer`` as without Ray, then ``prepare_trainer`` (every rank reports the checkpoint files
it owns to Ray) and ``resume_checkpoint()`` (the checkpoint Ray hands a restarted worker group, or
None). The model is a small ``BertForSequenceClassification`` built from a config; the data is a
synthetic task generated in code (is a sequence mostly made of low token ids?).
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import torch
from transformers import BertConfig, BertForSequenceClassification

from hf_lowzero import LowZeroTrainer, LowZeroTrainingArguments
from hf_lowzero.ray import InjectWorkerFailure, local_output_dir, prepare_trainer, resume_checkpoint

VOCAB, SEQ_LEN = 64, 16


def tiny_bert(seed: int) -> BertForSequenceClassification:
    torch.manual_seed(seed)
    config = BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=64, max_position_embeddings=SEQ_LEN, num_labels=2)  # fmt: skip
    return BertForSequenceClassification(config)


class LowTokenDataset(torch.utils.data.Dataset):
    """``n`` random sequences; the label says whether most of a sequence's tokens are below VOCAB / 2."""

    def __init__(self, n: int = 256, seed: int = 0) -> None:
        generator = torch.Generator().manual_seed(seed)
        self.input_ids = torch.randint(1, VOCAB, (n, SEQ_LEN), generator=generator)
        self.labels = ((self.input_ids < VOCAB // 2).sum(dim=1) > SEQ_LEN // 2).long()

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.input_ids[i], "attention_mask": torch.ones(SEQ_LEN), "labels": self.labels[i]}


def training_arguments(output_dir: str, **overrides) -> LowZeroTrainingArguments:
    """The example's Trainer arguments; ``overrides`` are any ``LowZeroTrainingArguments`` fields."""
    defaults = dict(zero_stage=2, max_steps=30, save_steps=10, per_device_train_batch_size=8, learning_rate=2e-3,
                    logging_steps=1, report_to=[], disable_tqdm=True, use_cpu=True, seed=0)  # fmt: skip
    return LowZeroTrainingArguments(output_dir=output_dir, **(defaults | overrides))


def classifier_trainer(args: LowZeroTrainingArguments, callbacks=None) -> LowZeroTrainer:
    """The ``LowZeroTrainer`` of this example, with or without Ray."""
    return LowZeroTrainer(model=tiny_bert(args.seed), args=args, train_dataset=LowTokenDataset(), callbacks=callbacks)


def train_func(config: dict) -> None:
    """Runs on every Ray Train worker, once per attempt. ``config["training_args"]``: overrides of
    ``training_arguments`` (a Tune sweep searches them); ``config["callbacks"]``: more Trainer callbacks."""
    args = training_arguments(local_output_dir(), **config.get("training_args", {}))
    trainer = prepare_trainer(classifier_trainer(args, callbacks=config.get("callbacks")))
    trainer.train(resume_from_checkpoint=resume_checkpoint())


def main(argv=None) -> None:
    import ray
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num-workers", type=int, default=2)
    p.add_argument("--use-gpu", action="store_true", help="one GPU per worker, NCCL")
    p.add_argument("--storage-path", default=str(Path.home() / "ray_results"))
    p.add_argument("--name", default="hf_lowzero_classifier")
    p.add_argument("--max-failures", type=int, default=3)
    p.add_argument("--inject-failure-at-step", type=int, default=None, help="kill the last worker once, at this step")
    a = p.parse_args(argv)
    storage = a.storage_path if "://" in a.storage_path else os.path.abspath(a.storage_path)
    if os.environ.get("RAY_ADDRESS"):
        ray.init()
    else:
        os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
        ray.init(address="local", num_cpus=a.num_workers + 1, include_dashboard=False)
    config = {"training_args": {"use_cpu": not a.use_gpu}}
    if a.inject_failure_at_step:  # the marker that makes it happen once lives in the run's folder
        config["callbacks"] = [InjectWorkerFailure(a.inject_failure_at_step, Path(storage) / a.name)]
    trainer = TorchTrainer(
        train_func,
        train_loop_config=config,
        scaling_config=ScalingConfig(num_workers=a.num_workers, use_gpu=a.use_gpu),
        run_config=RunConfig(name=a.name, storage_path=storage, failure_config=FailureConfig(a.max_failures)),
    )
    result = trainer.fit()
    print(f"final loss {result.metrics['loss']:.4f} at step {result.metrics['step']}, resumed from step "
          f"{result.metrics['resumed_from_step']}; checkpoint {result.checkpoint.path}")  # fmt: skip


if __name__ == "__main__":
    main()
