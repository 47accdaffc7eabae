"""Every ``--optim`` choice of the plain Trainer trains under ``zero_stage`` 1 and 2 with the plain
Trainer's numbers (W=2, against DDP with the same optimizer), with its state sharded.

Element-wise optimizers get row shards; the rest (factored, 8-bit/4-bit block-wise, Lion, AdEMAMix,
schedule-free) whole-parameter ownership ([Note: two ways to own a parameter]). Optimizers from
optional packages skip, with the reason, when the package is missing.
"""

from __future__ import annotations

import importlib.util
import math

import pytest
import torch

from hf_lowzero import ChainedOptimizer
from hf_lowzero.testing import run_distributed
from hf_lowzero.zero.runtime.memory import tensor_bytes
from tests.hf_models import TokenDataset, tiny_gpt2
from tests.trainer_runs import logged, make_args, train

# optim -> the package it needs (None: transformers/torch alone)
OPTIMS = {
    "adamw_torch": None,
    "adamw_torch_fused": None,
    "sgd": None,
    "rmsprop": None,
    "adagrad": None,
    "adafactor": None,
    "adamw_torch_4bit": "torchao",
    "adamw_torch_8bit": "torchao",
    "adamw_bnb_8bit": "bitsandbytes",
    "paged_adamw_8bit": "bitsandbytes",
    "lion_8bit": "bitsandbytes",
    "lion_32bit": "bitsandbytes",
    "rmsprop_bnb_8bit": "bitsandbytes",
    "ademamix": "bitsandbytes",
    "schedule_free_adamw": "schedulefree",
    "schedule_free_sgd": "schedulefree",
}
ROWS = {"adamw_torch", "adamw_torch_fused", "sgd", "rmsprop", "adagrad"}  # what partition="auto" picks rows for


def state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of every state tensor, what quantized subclasses (torchao) store counted."""
    return tensor_bytes(v for entry in optimizer.state.values() for v in entry.values() if isinstance(v, torch.Tensor))


def run(rank: int, out, optim: str, stage: int):
    if importlib.util.find_spec("bitsandbytes") is not None:
        # bitsandbytes keeps per-parameter overrides (Trainer's 32-bit embeddings) process-wide, by
        # (group, position): start every run clean, as a process running one Trainer does.
        import bitsandbytes

        bitsandbytes.optim.GlobalOptimManager.get_instance().initialize()
    # One micro-batch per step, no clipping: both runs see the same gradients bit for bit, so the
    # optimizers alone are compared. (With accumulation, ZeRO-2 adds micro-batches after reducing
    # each and DDP before; a last-bit difference in an element whose gradient is near zero becomes
    # a 1e-5 difference after steps that normalize by |g| (RMSprop, Lion) or quantize the state.
    # Accumulation and clipping are optimizer-independent: tests/test_accumulation.py, test_grad_norm.py.)
    args = make_args(
        out / f"{optim}-{stage}",
        stage,
        optim=optim,
        max_steps=3,
        warmup_steps=0,
        learning_rate=1e-2,
        gradient_accumulation_steps=1,
        per_device_train_batch_size=4,
        max_grad_norm=0.0,
    )
    model = tiny_gpt2()
    trainer = train(model, args, eval_dataset=TokenDataset(n=8, seed=7))
    eval_loss = trainer.evaluate()["eval_loss"]  # schedule-free: evaluated at its averaged weights
    inner = trainer.zero_optimizer.optim if stage else trainer.optimizer.optimizer
    params = {n: p.detach().float().clone() for n, p in trainer.model.named_parameters()}
    partition = trainer.zero_optimizer.partition if stage else None
    return logged(trainer, "loss"), eval_loss, params, state_bytes(inner), partition


def body(rank: int, world_size: int, out, optims) -> None:
    for optim in optims:
        losses, eval_loss, params, plain_bytes, _ = run(rank, out, optim, 0)
        for stage in (1, 2):
            where = f"--optim {optim} zero_stage={stage} rank {rank}"
            z_losses, z_eval, z_params, z_bytes, partition = run(rank, out, optim, stage)
            assert partition == ("rows" if optim in ROWS else "params"), where
            assert len(z_losses) == len(losses) == 3 and all(map(math.isfinite, losses)), where
            assert z_losses == pytest.approx(losses, rel=1e-5), where
            assert z_eval == pytest.approx(eval_loss, rel=1e-5), where
            for name, p in params.items():
                torch.testing.assert_close(
                    z_params[name], p, rtol=1e-4, atol=1e-5, msg=lambda m, n=name, w=where: f"{w} {n}: {m}"
                )
            if plain_bytes:  # sharded: each rank holds well under the plain optimizer's state
                assert z_bytes < 0.75 * plain_bytes, (where, z_bytes, plain_bytes)


def available(optims):
    missing = {o: pkg for o, pkg in OPTIMS.items() if o in optims and pkg and importlib.util.find_spec(pkg) is None}
    return [o for o in optims if o not in missing], missing


@pytest.mark.parametrize("optims", [["adamw_torch", "adamw_torch_fused", "sgd", "rmsprop", "adagrad", "adafactor"]])
def test_torch_and_transformers_optimizers(tmp_path, optims):
    run_distributed(body, 2, out=tmp_path, optims=optims)


@pytest.mark.slow  # 10-15 s each (torchao compiles its step): the second tier keeps the fast one under 10 min
@pytest.mark.parametrize("package", ["torchao", "bitsandbytes", "schedulefree"])
def test_optional_package_optimizers(tmp_path, package):
    pytest.importorskip(package, reason=f"--optim choices of {package} need it installed (pip install -e .[test])")
    run_distributed(body, 2, out=tmp_path, optims=[o for o, pkg in OPTIMS.items() if pkg == package])


def resume_body(rank: int, world_size: int, out, optims) -> None:
    """Stop at step 2 and resume from the Trainer checkpoint: the same final params as the run that
    went on (whole-owned state: torchao's packed 8-bit tensors, bitsandbytes' uint8 codes and block
    scales, Adafactor's factored moments)."""
    for optim in optims:
        args = dict(optim=optim, max_steps=4, warmup_steps=0, learning_rate=1e-2, save_strategy="steps", save_steps=2)
        whole = train(tiny_gpt2(), make_args(out / f"{optim}-whole", 2, **args))
        resumed = train(
            tiny_gpt2(seed=3),
            make_args(out / f"{optim}-resumed", 2, **args),
            resume=out / f"{optim}-whole/checkpoint-2",
        )
        assert resumed.zero_optimizer.partition == "params"
        for (name, p), q in zip(whole.model.named_parameters(), resumed.model.parameters()):
            assert torch.equal(p, q), f"--optim {optim} rank {rank}: {name} differs after resuming"


@pytest.mark.slow  # test tiers (tests/tiers.py): long; shorter tests of this area stay fast
def test_whole_param_states_resume_from_trainer_checkpoints(tmp_path):
    optims, missing = available(["adafactor", "adamw_torch_8bit", "adamw_bnb_8bit"])
    for optim, package in missing.items():
        print(f"--optim {optim} not resumed: {package} is not installed")
    run_distributed(resume_body, 2, out=tmp_path, optims=optims)


def muon_chain(model) -> ChainedOptimizer:
    """torch's Muon for the 2-D weight matrices, AdamW for the rest (embeddings, biases, norms).

    AdamW's kernel is fixed (fused), so both runs use the same: ZeRO on CPU would pick the fused
    kernel where it is left open, and Muon's bf16 Newton-Schulz iteration turns the foreach
    kernel's last-bit differences into 1e-4 differences of the matrices."""
    matrices = [p for n, p in model.named_parameters() if p.ndim == 2 and not n.startswith("transformer.w")]
    rest = [p for n, p in model.named_parameters() if not (p.ndim == 2 and not n.startswith("transformer.w"))]
    return ChainedOptimizer(torch.optim.Muon(matrices, lr=0.02), torch.optim.AdamW(rest, lr=3e-3, fused=True))


def muon_body(rank: int, world_size: int, out) -> None:
    runs = {}
    for stage in (0, 1, 2):
        model = tiny_gpt2()
        args = make_args(
            out / f"muon-{stage}", stage, max_steps=3, warmup_steps=0, gradient_accumulation_steps=1, max_grad_norm=0.0
        )
        trainer = train(model, args, optimizers=(muon_chain(model), None))
        if stage:
            assert trainer.zero_optimizer.partition == "params"
            muon_state = trainer.zero_optimizer.optim.optimizers[0].state
            assert all(v["momentum_buffer"].ndim == 2 for v in muon_state.values())  # whole matrices
        runs[stage] = logged(trainer, "loss"), {n: p.detach().clone() for n, p in model.named_parameters()}
    for stage in (1, 2):
        assert runs[stage][0] == pytest.approx(runs[0][0], rel=1e-5), f"zero_stage={stage}"
        for name, p in runs[0][1].items():
            torch.testing.assert_close(
                runs[stage][1][name], p, rtol=1e-4, atol=1e-5, msg=lambda m, s=stage, n=name: f"stage {s} {n}: {m}"
            )


@pytest.mark.slow  # test tiers (tests/tiers.py): long; shorter tests of this area stay fast
def test_muon_for_matrices_and_adamw_for_the_rest_given_through_optimizers(tmp_path):
    run_distributed(muon_body, 2, out=tmp_path)
