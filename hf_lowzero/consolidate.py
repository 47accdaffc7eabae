"""Turn a sharded ZeRO checkpoint into full weights: a ``save_pretrained``-style directory.

    python -m hf_lowzero.consolidate CKPT_DIR OUT_DIR [--dtype bf16] [--config-from MODEL_DIR]

Writes ``OUT_DIR/model.safetensors`` (fp32 unless ``--dtype`` says otherwise); with
``--config-from`` also copies that directory's ``config.json`` (and generation config), so
``AutoModel.from_pretrained(OUT_DIR)`` loads the result. Needs no process group or GPU.
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

from safetensors.torch import save_file

from hf_lowzero.checkpoint import consolidate_checkpoint
from hf_lowzero.zero.config import parse_dtype


def write_pretrained_weights(ckpt: str | Path, out: str | Path, dtype=None) -> Path:
    """Consolidate ``ckpt`` into ``out/model.safetensors``; returns the written file."""
    weights = consolidate_checkpoint(ckpt)
    if dtype is not None:
        weights = {k: v.to(parse_dtype(dtype, "dtype")) for k, v in weights.items()}
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
    args = parser.parse_args(argv)
    target = write_pretrained_weights(args.checkpoint, args.out, args.dtype)
    if args.config_from:
        for name in ("config.json", "generation_config.json"):
            src = Path(args.config_from) / name
            if src.is_file():
                shutil.copy(src, Path(args.out) / name)
    print(f"wrote {target}")


if __name__ == "__main__":
    main()
