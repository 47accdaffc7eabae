"""What a memory plan simulates: the user's model, built from its config, and one batch for it.

The same builder runs under ``FakeTensorMode`` (planning: no weights exist) and on real tensors
(measuring a real step to check the plan), so both see the same modules, dtypes and inputs.

Example::

    spec = ModelSpec.from_source("path/to/model_dir")        # or a config.json, a PretrainedConfig, a model
    model = spec.build(torch.bfloat16)                         # under FakeTensorMode: no memory is used
    loss = model(**spec.batch(batch_size=8, seq_len=1024)).loss
"""

from __future__ import annotations

import copy
import json
import os
import re
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

# Config fields of attention dropout in transformers' models (GPT-2, BERT/RoBERTa, Llama/Mistral/Qwen, ...).
_ATTENTION_DROPOUT = ("attn_pdrop", "attention_probs_dropout_prob", "attention_dropout", "attn_dropout")
# Heads the plan knows how to feed, in the order a config without ``architectures`` is tried.
_AUTO_CLASSES = ("AutoModelForCausalLM", "AutoModelForSeq2SeqLM", "AutoModelForMaskedLM", "AutoModel")


@dataclass
class ModelSpec:
    """A model to plan for: its config and class, and the LoRA adapter (if any) put on it."""

    config: Any  # transformers.PretrainedConfig
    model_class: type
    lora_r: int | None = None
    lora_targets: list[str] | None = None
    name: str = ""
    kind: str = field(init=False)  # "causal", "seq2seq", "masked" or "classification": what batch it takes

    def __post_init__(self) -> None:
        self.kind = _kind_of(self.model_class)
        if self.lora_r is not None and (isinstance(self.lora_r, bool) or int(self.lora_r) < 1):
            raise ValueError(f"lora_r={self.lora_r!r} is invalid; expected a LoRA rank >= 1 (or None: no adapter)")

    @classmethod
    def from_source(cls, source: Any, lora_r: int | None = None, lora_targets: list[str] | None = None) -> ModelSpec:
        """A spec from a model directory, a ``config.json`` path, a ``PretrainedConfig``, a
        ``PreTrainedModel`` or a PEFT model (its base config, class and LoRA rank/targets)."""
        from transformers import PretrainedConfig, PreTrainedModel

        if isinstance(source, ModelSpec):
            return source
        if hasattr(source, "peft_config") and hasattr(source, "get_base_model"):
            peft_config = next(iter(source.peft_config.values()))
            base = source.get_base_model()
            targets = sorted(peft_config.target_modules) if peft_config.target_modules else None
            return cls(base.config, type(base), lora_r or peft_config.r, lora_targets or targets, _name(base.config))
        if isinstance(source, PreTrainedModel):
            return cls(source.config, type(source), lora_r, lora_targets, _name(source.config))
        if isinstance(source, PretrainedConfig):
            return cls(source, _class_for(source), lora_r, lora_targets, _name(source))
        if isinstance(source, (str, os.PathLike)):
            config = _load_config(os.fspath(source))
            return cls(config, _class_for(config), lora_r, lora_targets, _name(config, os.fspath(source)))
        raise TypeError(
            f"cannot plan for a {type(source).__name__}; pass a model directory, a config.json path, a "
            "transformers PretrainedConfig or PreTrainedModel, or a PEFT model"
        )

    def as_on_gpu(self) -> ModelSpec:
        """This spec with attention dropout off ([Note: attention on the GPU] in simulate.py)."""
        config = copy.deepcopy(self.config)
        for name in _ATTENTION_DROPOUT:
            if isinstance(getattr(config, name, None), float):
                setattr(config, name, 0.0)
        return ModelSpec(config, self.model_class, self.lora_r, self.lora_targets, self.name)

    def build(
        self, dtype: torch.dtype, gradient_checkpointing: bool = False, checkpointing_kwargs=None, device=None
    ) -> nn.Module:
        """The model in ``dtype`` (with its LoRA adapter), as the Trainer would train it. Under an
        active ``FakeTensorMode`` nothing is allocated: the model is built on the meta device, where
        module conversions (PEFT casting its adapter) work, then given fake storage on ``device``
        (default: the CPU; fake ``cuda`` tensors need a fake-GPU process: ``hf_lowzero.simulation``)."""
        from torch._guards import active_fake_mode
        from torch._subclasses.fake_tensor import unset_fake_temporarily

        from hf_lowzero.simulation.gpu_step import fake_storage

        if active_fake_mode() is None:
            return self._build(dtype, gradient_checkpointing, checkpointing_kwargs)
        with unset_fake_temporarily(), torch.device("meta"):
            model = self._build(dtype, gradient_checkpointing, checkpointing_kwargs)
        return fake_storage(model, device or "cpu")

    def _build(self, dtype: torch.dtype, gradient_checkpointing: bool, checkpointing_kwargs) -> nn.Module:
        # Every tensor is created in ``dtype``, the adapter too: the ZeRO Trainer casts the whole model.
        previous = torch.get_default_dtype()
        torch.set_default_dtype(dtype)
        try:
            model = self.model_class._from_config(self.config, dtype=dtype)
            if gradient_checkpointing:
                model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=checkpointing_kwargs)
            if self.lora_r is not None:
                from peft import LoraConfig, get_peft_model

                r = int(self.lora_r)
                lora = LoraConfig(r=r, lora_alpha=2 * r, target_modules=self.lora_targets)
                model = get_peft_model(model, lora, autocast_adapter_dtype=False)
                if gradient_checkpointing:
                    model.enable_input_require_grads()  # as Trainer does for a PEFT model with a frozen embedding
        finally:
            torch.set_default_dtype(previous)
        return model

    def batch(self, batch_size: int, seq_len: int, device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
        """One training batch of ``batch_size`` sequences of ``seq_len`` tokens, with labels."""
        vocab = int(getattr(self.config, "vocab_size", 1000))
        g = torch.Generator().manual_seed(0)
        ids = torch.randint(0, vocab, (batch_size, seq_len), generator=g).to(device)
        if self.kind == "seq2seq":
            return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}
        if self.kind == "classification":
            labels = torch.zeros(batch_size, dtype=torch.long, device=device)
            return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels}
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}

    def max_seq_len(self) -> int | None:
        for name in ("max_position_embeddings", "n_positions", "max_sequence_length"):
            value = getattr(self.config, name, None)
            if isinstance(value, int) and value > 0:
                return value
        return None


def _name(config, source: str | None = None) -> str:
    if source is not None:
        return os.path.basename(os.path.normpath(source.removesuffix("config.json"))) or config.model_type
    return getattr(config, "_name_or_path", "") or config.model_type


def _load_config(path: str):
    from transformers import AutoConfig

    if os.path.isdir(path):
        return AutoConfig.from_pretrained(path)
    if os.path.isfile(path):
        with open(path) as f:
            try:
                data = json.load(f)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path} is not a JSON config: {e}") from e
        if "model_type" not in data:
            raise ValueError(f"{path} has no 'model_type': expected a transformers config.json")
        return AutoConfig.for_model(**data)
    if _HUB_ID.match(path):
        return _hub_config(path)
    raise FileNotFoundError(f"{path} is neither a model directory nor a config.json file")


_HUB_ID = re.compile(r"^[\w.-]+(/[\w.-]+)?$")  # "gpt2", "meta-llama/Llama-3.1-8B"


def _hub_config(repo_id: str):
    """The config of Hub model ``repo_id``, as ``accelerate estimate-memory`` reads it: from the local
    Hugging Face cache, else from the Hub (only ``config.json``; no weights are downloaded)."""
    from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError
    from transformers import AutoConfig

    todo = f"pass a local directory or a config.json (e.g. downloaded with `hf download {repo_id} config.json`)"
    try:
        return AutoConfig.from_pretrained(repo_id)
    except GatedRepoError:
        raise FileNotFoundError(
            f"{repo_id} is a gated model on the Hugging Face Hub: accept its terms on huggingface.co and log in "
            f"(`hf auth login`), or {todo}"
        ) from None
    except RepositoryNotFoundError:
        raise FileNotFoundError(f"{repo_id} is no local path and no model on the Hugging Face Hub; {todo}") from None
    except (OSError, ValueError) as e:  # offline and not cached, or a config transformers cannot read
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise FileNotFoundError(
            f"{repo_id} is no local path, and its config is neither in the Hugging Face cache nor reachable on the "
            f"Hub ({reason}); {todo}"
        ) from None


def _class_for(config) -> type:
    import transformers

    for name in getattr(config, "architectures", None) or []:
        cls = getattr(transformers, name, None)
        if cls is not None:
            return cls
    for auto_name in _AUTO_CLASSES:
        auto = getattr(transformers, auto_name)
        mapping = auto._model_mapping
        if type(config) in mapping:
            return mapping[type(config)]
    raise ValueError(f"no transformers model class found for model_type {config.model_type!r}")


def _kind_of(model_class: type) -> str:
    name = model_class.__name__
    if "ForConditionalGeneration" in name and "T5" in name or "Seq2Seq" in name or name.startswith(("Bart", "MT5")):
        return "seq2seq"
    if "SequenceClassification" in name:
        return "classification"
    if "MaskedLM" in name or "ForPreTraining" in name:
        return "masked"
    return "causal"
