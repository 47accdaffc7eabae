"""Tiny pieces for the TRL and Seq2Seq tests, built offline: a character tokenizer, causal-LM and T5
models from configs, and small text datasets (SFT text, DPO preferences, GRPO prompts)."""

from __future__ import annotations

import string

import torch
from datasets import Dataset
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import GPT2LMHeadModel, PreTrainedTokenizerFast, T5Config, T5ForConditionalGeneration

from tests.hf_models import tiny_gpt2

SPECIAL = ["<pad>", "<eos>", "<unk>"]
CHARS = string.ascii_lowercase + " .,"
WORDS = ["zero", "shards", "the", "optimizer", "state", "across", "ranks", "and", "reduces", "gradients", "in"]


def char_tokenizer() -> PreTrainedTokenizerFast:
    """One token per character, plus pad/eos/unk."""
    vocab = {tok: i for i, tok in enumerate(SPECIAL + list(CHARS))}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    backend.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>", padding_side="left"
    )


def tiny_causal_lm(tokenizer, seed: int = 0) -> GPT2LMHeadModel:
    ids = tokenizer.pad_token_id, tokenizer.eos_token_id
    return tiny_gpt2(seed, vocab_size=len(tokenizer), n_positions=64, pad_token_id=ids[0], bos_token_id=ids[1],
                     eos_token_id=ids[1])  # fmt: skip


def tiny_t5(tokenizer, seed: int = 0) -> T5ForConditionalGeneration:
    torch.manual_seed(seed)
    config = T5Config(
        vocab_size=len(tokenizer),
        d_model=32,
        d_kv=8,
        d_ff=48,
        num_layers=2,
        num_decoder_layers=2,
        num_heads=2,
        dropout_rate=0.0,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        decoder_start_token_id=tokenizer.pad_token_id,
    )
    return T5ForConditionalGeneration(config)


def _phrases(n: int, seed: int, length: int = 3) -> list[str]:
    g = torch.Generator().manual_seed(seed)
    return [" ".join(WORDS[i] for i in torch.randint(0, len(WORDS), (length,), generator=g)) for _ in range(n)]


def sft_dataset(n: int = 32) -> Dataset:
    return Dataset.from_dict({"text": _phrases(n, seed=1, length=4)})


def preference_dataset(n: int = 16) -> Dataset:
    return Dataset.from_dict(
        {"prompt": _phrases(n, seed=2, length=2), "chosen": _phrases(n, seed=3), "rejected": _phrases(n, seed=4)}
    )


def prompt_dataset(n: int = 16) -> Dataset:
    return Dataset.from_dict({"prompt": _phrases(n, seed=5, length=2)})


def vowel_reward(completions, **kwargs) -> list[float]:
    """A GRPO reward: the share of vowels in each completion."""
    return [sum(c in "aeiou" for c in text) / max(len(text), 1) for text in completions]


def seq2seq_dataset(tokenizer, n: int = 16) -> Dataset:
    """Copy a phrase, reversed word order: inputs and labels as token ids."""
    sources = _phrases(n, seed=6)
    targets = [" ".join(reversed(s.split())) for s in sources]
    return Dataset.from_dict({"input_ids": tokenizer(sources)["input_ids"], "labels": tokenizer(targets)["input_ids"]})
