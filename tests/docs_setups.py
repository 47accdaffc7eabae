"""The setups that the docs' Python blocks name (``<!-- test: setup=NAME -->``): what a reader has
at hand before the block (a model, a dataset, a process group), built here from configs, since
nothing downloads. Each returns the names it defines."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch


def tiny_model(work: Path) -> dict:
    """``model_dir``/``export_dir`` (a ``from_pretrained`` directory of a tiny byte-level GPT-2, as
    the main job exports), ``model`` (loaded from it) and ``ds``/``dataset`` (fixed token sequences)."""
    from transformers import AutoModelForCausalLM

    from tests.hf_models import TokenDataset, tiny_gpt2

    model_dir = work / "model"
    tiny_gpt2(vocab_size=257, n_positions=128, bos_token_id=256, eos_token_id=256).save_pretrained(model_dir)
    ds = TokenDataset(n=16, length=16)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    return dict(model_dir=str(model_dir), export_dir=str(model_dir), model=model, ds=ds, dataset=ds)


def sft(work: Path) -> dict:
    """TRL's SFT pieces: ``tokenizer`` (one token per character), ``model``, ``ds`` (text) and the
    command line the block parses (``sys.argv``)."""
    from tests.trl_setup import char_tokenizer, sft_dataset, tiny_causal_lm

    tokenizer = char_tokenizer()
    sys.argv = ["sft.py", "--output_dir", str(work / "sft"), "--zero_stage", "2", "--bf16", "false", "--use_cpu",
                "true", "--max_steps", "2", "--max_length", "32", "--report_to", "none"]  # fmt: skip
    return dict(tokenizer=tokenizer, model=tiny_causal_lm(tokenizer), ds=sft_dataset())


def training_loop(work: Path) -> dict:
    """What a training loop has before it builds its optimizer: ``build_model`` and ``loader``."""
    from tests.hf_models import TokenDataset, tiny_gpt2

    loader = torch.utils.data.DataLoader(TokenDataset(n=8, length=16), batch_size=4)
    return dict(build_model=tiny_gpt2, loader=loader)


def process_group(work: Path) -> dict:
    """A process group of the ranks this block runs on (gloo), ``model`` and ``inner`` (a torch AdamW on it)."""
    from tests.hf_models import tiny_gpt2

    torch.distributed.init_process_group("gloo")
    model = tiny_gpt2()
    return dict(model=model, inner=torch.optim.AdamW(model.parameters(), lr=1e-3))


def optimizer(work: Path) -> dict:
    """``process_group``, and ``opt``: a ZeRO-2 optimizer on ``model`` after one step, its gathers in flight."""
    from hf_lowzero import LowLevelZeroOptimizer
    from tests.hf_models import TokenDataset

    names = process_group(work)
    opt = LowLevelZeroOptimizer(names["model"], names["inner"], stage=2, overlap_allgather=True)
    batch = TokenDataset(n=4, length=16)[0]
    opt.backward(names["model"](input_ids=batch["input_ids"][None], labels=batch["labels"][None]).loss)
    opt.step()
    return names | dict(opt=opt)


def ray_local(work: Path) -> dict:
    """A local Ray instance of its own (2 CPUs), and ``storage``: a folder for the run's checkpoints."""
    import ray

    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    # address="local": without it ray.init() joins the newest Ray instance on this machine, another
    # test lane's cluster included (.ci/run), and refuses num_cpus there.
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": str(Path(__file__).resolve().parents[1])}})  # fmt: skip
    return dict(storage=str(work / "storage"))


SETUPS = {
    "tiny-model": tiny_model,
    "sft": sft,
    "training-loop": training_loop,
    "process-group": process_group,
    "optimizer": optimizer,
    "ray": ray_local,
}
