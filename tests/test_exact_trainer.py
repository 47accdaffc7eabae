"""``zero_reduction="exact"`` on the Trainer: with the global batch fixed (per-device batch 2, accumulation
4 / W), W = 1 and 2 train bit-identical params, with dropout on ([Note: an exact Trainer step]).

Both loss normalizations are covered: GPT-2 normalizes by the step's token count (the optimizer sums),
and with ``model_accepts_loss_kwargs`` off the Trainer takes each micro-batch's mean (the optimizer
averages); "exact" stays within float rounding of "ddp" in both.
"""

from __future__ import annotations

import os

import pytest
import torch

from hf_lowzero import LowZeroTrainer
from hf_lowzero.testing import run_distributed
from hf_lowzero.trainer.exact import micro_batch_seed
from tests.hf_models import TokenDataset, tiny_gpt2
from tests.tiers import slow
from tests.trainer_runs import logged, make_args

GLOBAL_MICRO_BATCHES, STEPS = 4, 4
DROPOUT = dict(resid_pdrop=0.1, embd_pdrop=0.1, attn_pdrop=0.1)

# name -> (stage, dropout, by token count, arguments)
CASES = {
    "stage 2 dropout tokens": (2, True, True, {}),
    "stage 1 bf16 dropout mean": (1, True, False, dict(bf16=True)),
    "stage 2 tokens": (2, False, True, {}),
    "stage 2 mean": (2, False, False, {}),
}


def run_case(rank: int, world_size: int, tmp: str, name: str, reduction: str) -> dict:
    stage, dropout, by_tokens, extra = CASES[name]
    model = tiny_gpt2(**(DROPOUT if dropout else {}))
    args = make_args(
        f"{tmp}/{name}-{reduction}-{world_size}",
        stage,
        gradient_accumulation_steps=GLOBAL_MICRO_BATCHES // world_size,
        max_steps=STEPS,
        zero_reduction=reduction,
        **extra,
    )
    trainer = LowZeroTrainer(model=model, args=args, train_dataset=TokenDataset(n=64))
    trainer.model_accepts_loss_kwargs = by_tokens
    trainer.train()
    trainer.zero_optimizer.wait_for_params()
    return {
        "params": {n: p.detach().clone() for n, p in model.named_parameters()},
        "loss": logged(trainer, "loss"),
        "grad_norm": logged(trainer, "grad_norm"),
    }


def trainer_body(rank: int, world_size: int, tmp: str, out: str, runs: list[tuple[str, str]]) -> None:
    # accelerate gives each CPU rank cores / W threads unless told, and other threads sum in another order
    os.environ["OMP_NUM_THREADS"] = "1"
    results = {run: run_case(rank, world_size, tmp, *run) for run in runs}
    if rank == 0:
        torch.save(results, out)


def run_all(tmp_path, world_size: int, runs: list[tuple[str, str]]) -> dict:
    out = str(tmp_path / f"w{world_size}.pt")
    run_distributed(trainer_body, world_size, tmp=str(tmp_path), out=out, runs=runs)
    return torch.load(out)


@pytest.mark.parametrize("world_size", [2, slow(4)])
def test_trainer_same_bits_at_any_world_size(world_size, tmp_path):
    exact = [(name, "exact") for name in CASES]
    ddp = [(name, "ddp") for name, case in CASES.items() if not case[1]] if world_size == 2 else []
    reference = run_all(tmp_path, 1, exact)
    results = run_all(tmp_path, world_size, exact + ddp)
    for run in exact:
        one, many = reference[run], results[run]
        assert many["grad_norm"] == one["grad_norm"], run
        assert many["loss"] == pytest.approx(one["loss"], rel=1e-6), run  # logged: averaged over ranks in float
        for name, p in one["params"].items():
            assert torch.equal(p, many["params"][name]), f"{run}: {name} at W={world_size}"
    for name, _ in ddp:  # the loss normalization: exact is ddp up to the rounding of the sums
        exact_run, ddp_run = results[(name, "exact")], results[(name, "ddp")]
        assert exact_run["loss"] == pytest.approx(ddp_run["loss"], rel=1e-5), name
        assert exact_run["grad_norm"] == pytest.approx(ddp_run["grad_norm"], rel=1e-4), name
        for n, p in exact_run["params"].items():
            torch.testing.assert_close(p, ddp_run["params"][n], rtol=1e-4, atol=1e-5)


def test_micro_batch_seeds_differ():
    seeds = {micro_batch_seed(0, step, index) for step in range(50) for index in range(50)}
    assert len(seeds) == 2500 and all(0 <= s < 2**63 for s in seeds)
    assert micro_batch_seed(0, 3, 1) != micro_batch_seed(1, 3, 1)


def test_arguments(tmp_path):
    from transformers import HfArgumentParser

    from hf_lowzero import LowZeroTrainingArguments

    flags = ["--output_dir", str(tmp_path), "--use_cpu", "--zero_stage", "1", "--zero_reduction", "exact"]
    (args,) = HfArgumentParser(LowZeroTrainingArguments).parse_args_into_dataclasses(flags)
    assert args.to_zero_config().reduction == "exact"
    assert LowZeroTrainingArguments(output_dir=str(tmp_path), zero_stage=2).to_zero_config().reduction == "ddp"
    refusals = {
        "needs zero_stage 1 or 2": dict(zero_stage=0),
        "train_sampling_strategy='group_by_length'": dict(train_sampling_strategy="group_by_length"),
        "needs average_tokens_across_devices=True": dict(average_tokens_across_devices=False),
        "reduction='exactly' is invalid": dict(zero_reduction="exactly"),
    }
    for message, fields in refusals.items():
        given = dict(output_dir=str(tmp_path), use_cpu=True, zero_stage=2, zero_reduction="exact") | fields
        with pytest.raises(ValueError, match=message.replace("(", r"\(")):
            LowZeroTrainingArguments(**given)


def test_partial_global_batch_refused(tmp_path, single_rank_group, monkeypatch):
    """60 samples are 7 global batches of 8 and a half: the epoch's last step is refused, naming the numbers."""
    monkeypatch.setenv("OMP_NUM_THREADS", str(torch.get_num_threads()))
    epoch = dict(max_steps=-1, num_train_epochs=1)
    args = make_args(tmp_path, 2, gradient_accumulation_steps=4, zero_reduction="exact", **epoch)
    trainer = LowZeroTrainer(model=tiny_gpt2(), args=args, train_dataset=TokenDataset(n=60))
    with pytest.raises(ValueError, match=r"this step has 2 micro-batches per rank.*batches of 2 x 4 x 1 samples"):
        trainer.train()
    assert trainer.state.global_step == 7


def test_resume_with_another_per_device_batch_refused(tmp_path, single_rank_group, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", str(torch.get_num_threads()))
    saved = dict(max_steps=2, save_strategy="steps", save_steps=2, zero_reduction="exact")
    LowZeroTrainer(model=tiny_gpt2(), args=make_args(tmp_path, 2, **saved), train_dataset=TokenDataset(n=64)).train()
    args = make_args(tmp_path, 2, per_device_train_batch_size=4, gradient_accumulation_steps=1, **saved)
    trainer = LowZeroTrainer(model=tiny_gpt2(), args=args, train_dataset=TokenDataset(n=64))
    message = r"checkpoint-2 was trained with per_device_train_batch_size=2, this run has 4.*Resume with"
    with pytest.raises(ValueError, match=message):
        trainer.train(resume_from_checkpoint=str(tmp_path / "checkpoint-2"))
