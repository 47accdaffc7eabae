"""Causal-LM fine-tuning recipe shared by ``examples/finetune_clm.py`` and the Ray job.

Text is tokenized as UTF-8 bytes (no tokenizer download needed); a model directory given with
``model_name_or_path`` is loaded with ``from_pretrained`` (and its tokenizer, if it has one).

Example::

    model_args = ClmArguments(train_file="examples/data/zero_notes.txt")
    args = LowZeroTrainingArguments(output_dir="out", zero_stage=2, max_steps=20)
    metrics = finetune_clm(model_args, args)
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    GPT2Config,
    GPT2LMHeadModel,
    PrinterCallback,
    ProgressCallback,
    TrainerCallback,
)

from hf_lowzero.trainer.arguments import LowZeroTrainingArguments
from hf_lowzero.trainer.trainer import LowZeroTrainer

DEFAULT_CORPUS = Path(__file__).resolve().parents[1] / "data" / "zero_notes.txt"  # shipped with the package
BYTE_VOCAB = 257  # 256 byte values + end-of-text


@dataclass
class ClmArguments:
    model_name_or_path: str | None = field(
        default=None,
        metadata={"help": "Local model directory for from_pretrained; default: a tiny GPT-2 from a config"},
    )
    train_file: str = field(default=str(DEFAULT_CORPUS), metadata={"help": "Plain-text training corpus"})
    block_size: int = field(default=64, metadata={"help": "Tokens per training sequence"})
    n_layer: int = field(default=2, metadata={"help": "Layers of the tiny GPT-2 (ignored with model_name_or_path)"})
    n_embd: int = field(default=64, metadata={"help": "Width of the tiny GPT-2 (ignored with model_name_or_path)"})


class BlockDataset(torch.utils.data.Dataset):
    """Consecutive ``block_size`` chunks of a token stream, as causal-LM examples."""

    def __init__(self, token_ids: list[int], block_size: int) -> None:
        n = len(token_ids) // block_size
        if n == 0:
            raise ValueError(f"corpus has {len(token_ids)} tokens, fewer than block_size={block_size}")
        self.blocks = torch.tensor(token_ids[: n * block_size]).view(n, block_size)

    def __len__(self) -> int:
        return len(self.blocks)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.blocks[i], "labels": self.blocks[i]}


def build_model_and_tokens(model_args: ClmArguments, seed: int):
    """The model and the corpus as token ids (tokenizer from the model dir, else UTF-8 bytes)."""
    text = Path(model_args.train_file).read_text(encoding="utf-8")
    if model_args.model_name_or_path:
        model = AutoModelForCausalLM.from_pretrained(model_args.model_name_or_path)
        if os.path.isfile(os.path.join(model_args.model_name_or_path, "tokenizer_config.json")):
            return model, AutoTokenizer.from_pretrained(model_args.model_name_or_path)(text)["input_ids"]
        return model, list(text.encode("utf-8"))
    torch.manual_seed(seed)
    config = GPT2Config(
        vocab_size=BYTE_VOCAB,
        n_positions=max(128, model_args.block_size),
        n_embd=model_args.n_embd,
        n_layer=model_args.n_layer,
        n_head=4,
        bos_token_id=256,
        eos_token_id=256,
    )
    return GPT2LMHeadModel(config), list(text.encode("utf-8"))


def clm_trainer(
    model_args: ClmArguments,
    args: LowZeroTrainingArguments,
    callbacks=None,
    printer: TrainerCallback | None = None,
) -> LowZeroTrainer:
    """The ``LowZeroTrainer`` of the causal-LM fine-tune, ready to ``train()``; ``printer`` replaces
    the Trainer's own log printer (``PrinterCallback``/``ProgressCallback``).

    Example (the Ray job's workers, with ``hf_lowzero.ray``'s public pieces)::

        trainer = prepare_trainer(clm_trainer(model_args, args, printer=ConsoleProgress()))
        trainer.train(resume_from_checkpoint=resume_checkpoint())
    """
    model, token_ids = build_model_and_tokens(model_args, args.seed)
    if model.loss_type is None:  # e.g. GPT2LMHeadModel: no loss matches its class name; say which one it gets
        model.loss_type = "ForCausalLM"
    dataset = BlockDataset(token_ids, model_args.block_size)
    trainer = LowZeroTrainer(model=model, args=args, train_dataset=dataset, callbacks=callbacks)
    if printer is not None:
        trainer.remove_callback(PrinterCallback if args.disable_tqdm else ProgressCallback)
        trainer.add_callback(printer)
    return trainer


def finetune_clm(model_args: ClmArguments, args: LowZeroTrainingArguments, callbacks=None, resume=None):
    """Fine-tune a causal LM with ``LowZeroTrainer``; save the final model to ``args.output_dir``.

    Returns ``(trainer, metrics)``; ``resume`` is passed to ``train(resume_from_checkpoint=...)``.
    """
    trainer = clm_trainer(model_args, args, callbacks=callbacks)
    result = trainer.train(resume_from_checkpoint=resume)
    trainer.save_model()
    return trainer, result.metrics
