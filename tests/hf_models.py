"""Tiny Hugging Face models built from configs (no downloads) and deterministic datasets."""

from __future__ import annotations

import torch
from transformers import BertConfig, BertForSequenceClassification, GPT2Config, GPT2LMHeadModel

VOCAB = 97


def tiny_gpt2(seed: int = 0, **config) -> GPT2LMHeadModel:
    """A 2-layer, 32-wide GPT-2 without dropout; ``config`` overrides any GPT2Config field."""
    torch.manual_seed(seed)
    defaults = dict(n_positions=32, n_embd=32, n_layer=2, n_head=2, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return GPT2LMHeadModel(GPT2Config(**({"vocab_size": VOCAB} | defaults | config)))


def tiny_bert(seed: int = 0) -> BertForSequenceClassification:
    torch.manual_seed(seed)
    config = BertConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=37,
        max_position_embeddings=32,
        num_labels=3,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    return BertForSequenceClassification(config)


class TokenDataset(torch.utils.data.Dataset):
    """``n`` fixed random sequences; causal-LM labels or a class label per sequence."""

    def __init__(self, n: int = 64, length: int = 16, task: str = "clm", seed: int = 123) -> None:
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(0, VOCAB, (n, length), generator=g)
        self.classes = torch.randint(0, 3, (n,), generator=g)
        self.task = task

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        if self.task == "clm":
            return {"input_ids": self.ids[i], "labels": self.ids[i]}
        return {"input_ids": self.ids[i], "attention_mask": torch.ones_like(self.ids[i]), "labels": self.classes[i]}
