"""Turn a sharded ZeRO checkpoint into full weights: a ``save_pretrained``-style directory.

    python -m hf_lowzero.consolidate CKPT_DIR OUT_DIR [--dtype bf16] [--config-from MODEL_DIR]
        [--base-weights DIR_OR_FILE]

Writes ``OUT_DIR/model.safetensors`` (fp32 unless ``--dtype`` says otherwise); with
``--config-from`` also copies that directory's ``config.json`` (and generation config), so
``AutoModel.from_pretrained(OUT_DIR)`` loads the result. A Trainer checkpoint's
``checkpoint-N/zero_optimizer`` holds only the trainable params (the Trainer saves the model
itself): ``--base-weights checkpoint-N`` (or any ``*.safetensors`` file or directory of them with
the same names) supplies the frozen params and buffers. Needs no process group or GPU.

From Python, ``export_pretrained(checkpoint-N, OUT_DIR)`` does all of it for a Trainer checkpoint.
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from hf_lowzero.checkpoint import consolidate_checkpoint
from hf_lowzero.zero.zero_config import parse_dtype


def read_weights(path: str | Path) -> dict:
    """Every tensor of a ``.safetensors`` file, or of all ``*.safetensors`` files in a directory."""
    path = Path(path)
    files = sorted(path.glob("*.safetensors")) if path.is_dir() else [path]
    if not files:
        raise FileNotFoundError(f"{path}: no .safetensors weights found")
    weights = {}
    for file in files:
        weights.update(load_file(str(file)))
    return weights


def write_pretrained_weights(ckpt: str | Path, out: str | Path, dtype=None, base_weights=None) -> Path:
    """Consolidate ``ckpt`` into ``out/model.safetensors``; returns the written file."""
    base = read_weights(base_weights) if base_weights is not None else None
    return _save_weights(consolidate_checkpoint(ckpt, base=base), out, dtype)


def export_pretrained(
    trainer_checkpoint: str | Path, out: str | Path, tokenizer_from: str | Path | None = None
) -> Path:
    """Turn a Trainer ``checkpoint-N`` folder into a ``from_pretrained`` directory; returns ``out``.

    Writes full fp32 weights (consolidated from the ZeRO shards in ``checkpoint-N/zero_optimizer``,
    the frozen params and buffers taken from the Trainer's weights next to them; a run without ZeRO
    has only the Trainer's weights, which are complete), the config (dtype float32), the generation
    config and the tokenizer of the checkpoint or else of ``tokenizer_from``, if either has one.

    Example::

        >>> export_pretrained("out/checkpoint-40", "out/final")
        >>> model = AutoModelForCausalLM.from_pretrained("out/final")
    """
    from transformers import AutoConfig, AutoTokenizer  # only this function needs transformers

    source, out = Path(trainer_checkpoint), Path(out)
    if not (source / "config.json").is_file():
        raise FileNotFoundError(
            f"{source} has no config.json: expected a Trainer checkpoint-N folder (config.json, model weights, "
            "zero_optimizer/)"
        )
    shards = source / "zero_optimizer"
    if shards.is_dir():
        write_pretrained_weights(shards, out, dtype="fp32", base_weights=source)
    else:
        _save_weights(read_weights(source), out, "fp32")
    config = AutoConfig.from_pretrained(source)
    config.dtype = torch.float32
    config.save_pretrained(out)
    if (source / "generation_config.json").is_file():
        shutil.copy(source / "generation_config.json", out / "generation_config.json")
    for candidate in (source, tokenizer_from):
        if candidate is not None and (Path(candidate) / "tokenizer_config.json").is_file():
            AutoTokenizer.from_pretrained(candidate).save_pretrained(out)
            break
    return out


def _save_weights(weights: dict[str, torch.Tensor], out: str | Path, dtype) -> Path:
    """Write ``out/model.safetensors`` atomically, floating-point tensors cast to ``dtype`` if given."""
    if dtype is not None:
        dtype = parse_dtype(dtype, "dtype")
        weights = {k: v.to(dtype) if v.is_floating_point() else v for k, v in weights.items()}
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    target = out / "model.safetensors"
    tmp = out / "model.safetensors.tmp"
    save_file({k: v.contiguous() for k, v in weights.items()}, str(tmp), metadata={"format": "pt"})
    tmp.replace(target)
    return target


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint", help="sharded checkpoint directory (holds zero_meta.json)")
    parser.add_argument("out", help="output directory for model.safetensors")
    parser.add_argument("--dtype", default=None, help="fp32 (default), bf16 or fp16")
    parser.add_argument("--config-from", default=None, help="copy config.json from this model directory")
    parser.add_argument(
        "--base-weights", default=None, help="safetensors file or directory with the frozen params and buffers"
    )
    args = parser.parse_args(argv)
    target = write_pretrained_weights(args.checkpoint, args.out, args.dtype, args.base_weights)
    if args.config_from:
        for name in ("config.json", "generation_config.json"):
            src = Path(args.config_from) / name
            if src.is_file():
                shutil.copy(src, Path(args.out) / name)
    print(f"wrote {target}")


if __name__ == "__main__":
    main()
