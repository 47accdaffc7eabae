"""The all-gather left in flight after the step ([Note: overlapped all-gather] in zero/update/allgather.py).

With ``overlap_allgather`` the step returns with every bucket's gather in flight, in the next
forward's order; each module's first forward use waits for its own buckets alone, and every other
reader passes one gate ([Note: params are current]). The result must be the bits of overlap off:
the optimizer alone and the Trainer, stage 1 and 2, W = 2, 3 and 4, with evaluation between steps,
a callback reading params after every step, and a save and resume. A model that reads a weight
outside the module holding it is stopped with an error naming it, on every rank.
"""

from __future__ import annotations

import copy
import os

import pytest
import torch
import torch.distributed as dist
from torch.nn.functional import mse_loss
from transformers import TrainerCallback

from hf_lowzero import LowLevelZeroOptimizer, load_checkpoint, save_checkpoint
from hf_lowzero.testing import run_distributed
from hf_lowzero.zero.build import CHECK_ENV
from hf_lowzero.zero.reads import StaleParamRead
from tests.hf_models import TokenDataset, tiny_gpt2
from tests.models import BranchyNet, batch, make_inner
from tests.tiers import slow
from tests.trainer_runs import logged, make_args, train

STEPS = 6


def _run(rank: int, stage: int, overlap: bool, tmp: str) -> dict:
    """Six steps with an evaluation forward every other step, an EMA of the params read after every
    step, and a save after step 3 that a fresh model and optimizer resume from."""
    model = BranchyNet()
    opt = LowLevelZeroOptimizer(
        model, make_inner("adamw", model), stage=stage, reduce_bucket_mb=0.0005, clip_grad_norm=0.5,
        overlap_allgather=overlap,
    )  # fmt: skip
    ema = [p.detach().clone() for p in model.parameters()]
    losses, evals = [], []
    for step in range(STEPS):
        if step == 3:  # a save, then a fresh model and optimizer resume from it
            save_checkpoint(opt, f"{tmp}/ckpt-{overlap}")
            model = BranchyNet(seed=1)
            opt = LowLevelZeroOptimizer(
                model, make_inner("adamw", model), stage=stage, reduce_bucket_mb=0.0005, clip_grad_norm=0.5,
                overlap_allgather=overlap,
            )  # fmt: skip
            load_checkpoint(opt, f"{tmp}/ckpt-{overlap}")
        x, y = batch(rank, step)
        use_a, use_b = (rank + step) % 2 == 0, step % 3 != 0
        loss = mse_loss(model(x, use_a, use_b), y)
        losses.append(loss.item())
        opt.backward(loss)
        assert opt.step()
        if step % 2 == 1:  # evaluation: a forward under no_grad waits for each module's gathers
            with torch.no_grad():
                evals.append(mse_loss(model(*batch(rank, 100 + step)[:1]), batch(rank, 100 + step)[1]).item())
        opt.wait_for_params()  # an EMA callback: it reads every param after the step
        with torch.no_grad():
            for e, p in zip(ema, model.parameters()):
                e.mul_(0.9).add_(p, alpha=0.1)
        opt.zero_grad()
    state = {k: v.clone() for k, v in model.state_dict().items()}  # the gate of model.state_dict()
    return {"losses": losses, "evals": evals, "ema": ema, "state": state}


def _bit_equal_body(rank: int, world_size: int, tmp: str) -> None:
    for stage in (1, 2):
        off, on = (_run(rank, stage, overlap, tmp) for overlap in (False, True))
        where = f"stage {stage}, W={world_size}, rank {rank}"
        assert on["losses"] == off["losses"] and on["evals"] == off["evals"], where
        for name in on["state"]:
            assert torch.equal(on["state"][name], off["state"][name]), f"{where}: {name}"
        assert all(torch.equal(a, b) for a, b in zip(on["ema"], off["ema"])), where


@pytest.mark.parametrize("world_size", [2, slow(3)])  # 3: the odd size; no 4, which proved nothing more
def test_overlapped_gathers_give_the_bits_of_waited_ones(world_size, tmp_path):
    run_distributed(_bit_equal_body, world_size, tmp=str(tmp_path))


def _in_flight_body(rank: int, world_size: int) -> None:
    model = BranchyNet()
    twin = copy.deepcopy(model)
    opt = LowLevelZeroOptimizer(
        model, make_inner("adamw", model), stage=2, reduce_bucket_mb=0.0005, overlap_allgather=True
    )
    twin_opt = LowLevelZeroOptimizer(twin, make_inner("adamw", twin), stage=2, reduce_bucket_mb=0.0005,
                                     overlap_allgather=False)  # fmt: skip
    x, y = batch(rank, 0)
    for m, o in ((model, opt), (twin, twin_opt)):
        o.backward(mse_loss(m(x), y))
        o.step()
    # In flight, in the forward's order: the buckets are planned backwards, so the last one first.
    in_flight = opt.gathers_in_flight
    assert in_flight == sorted(range(len(opt.buckets)), reverse=True), (in_flight, len(opt.buckets))
    assert twin_opt.gathers_in_flight == []
    # The first module's forward waits for its own buckets, and only those.
    own = {s.bucket_index for s in opt.slots if s.name.startswith("embed.")}
    hidden = torch.tanh(model.embed(x))
    assert opt.gathers_in_flight == [b for b in in_flight if b not in own]
    assert torch.equal(hidden, torch.tanh(twin.embed(x)))
    # model.state_dict() waits for every gather: the updated values, as without overlap.
    state, expected = model.state_dict(), twin.state_dict()
    assert opt.gathers_in_flight == [] and all(torch.equal(state[k], expected[k]) for k in expected)


def test_gathers_are_in_flight_in_forward_order_and_each_module_waits_for_its_own():
    run_distributed(_in_flight_body, 2)


class ReadsHeadOutside(BranchyNet):
    """Reads ``head``'s weight with a functional call in its own forward, outside ``head``'s forward;
    with ``late``, only from the second forward on (a path the learned first forward did not take)."""

    def __init__(self, late: bool = False) -> None:
        super().__init__()
        self.late, self.calls = late, 0

    def forward(self, x, use_a=True, use_b=True):
        self.calls += 1
        h = self.frozen(torch.tanh(self.embed(x)))
        out = torch.tanh(self.branch_a(h))
        if self.late and self.calls == 1:
            return self.head(out) * self.scale[:3].sum()
        return torch.nn.functional.linear(out, self.head.weight, self.head.bias) * self.scale[:3].sum()


def _outside_body(rank: int, world_size: int) -> None:
    losses = {}
    for overlap in (False, True):
        model = ReadsHeadOutside()
        opt = LowLevelZeroOptimizer(
            model, make_inner("sgd", model), stage=2, reduce_bucket_mb=0.0005, overlap_allgather=overlap
        )
        losses[overlap] = []
        for step in range(3):
            x, y = batch(rank, step)
            loss = mse_loss(model(x), y)
            losses[overlap].append(loss.item())
            opt.backward(loss)
            assert opt.step()
            opt.zero_grad()
    assert losses[True] == losses[False], losses


def test_a_weight_read_outside_its_module_waits_where_the_first_forward_read_it():
    """[Note: every read waits]: the first forward learns that the model's own forward reads head.*,
    so the root waits for their bucket; the losses are overlap off's, bit for bit."""
    run_distributed(_outside_body, 2)


def _stale_body(rank: int, world_size: int, check: bool) -> None:
    os.environ[CHECK_ENV] = "1" if check else "0"  # the suite's conftest switches the check on
    model = ReadsHeadOutside(late=True)
    opt = LowLevelZeroOptimizer(
        model, make_inner("sgd", model), stage=2, reduce_bucket_mb=0.0005, overlap_allgather=True,
        check_param_reads=check,
    )  # fmt: skip
    x, y = batch(rank, 0)
    opt.backward(mse_loss(model(x), y))
    assert opt.step()
    opt.zero_grad()
    x, y = batch(rank, 1)
    if check:  # the read itself raises, in the forward, naming the param and the module
        with pytest.raises(StaleParamRead, match=r"'head.weight' was read in the forward of '<root>' \(ReadsHead"):
            model(x)
        return
    opt.backward(mse_loss(model(x), y))  # the second forward read head.* outside head: not learned
    opt.wait_for_params()  # the last step's values land (the forward read the ones before)
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(RuntimeError, match=r"rank \d, \['head.weight', 'head.bias'\] got gradients"):
        opt.step()
    assert all(torch.equal(p, q) for p, q in zip(before, model.parameters())), "nothing may be updated"


@pytest.mark.parametrize("check", [False, True])
def test_a_read_on_a_path_taken_after_learning_is_named(check):
    """A path first taken after its kind of forward was learned reads head.* before their gather
    lands: every rank stops before the update, naming them; with check_param_reads the read itself
    raises in the forward, naming the param and the module."""
    run_distributed(_stale_body, 2, check=check)


# ------------------------------------------------------------------------------ the Trainer


class ParamEMA(TrainerCallback):
    """A user's callback: an exponential moving average of the weights, after every step."""

    def __init__(self) -> None:
        self.ema: list[torch.Tensor] | None = None

    def on_step_end(self, args, state, control, model=None, **kwargs):
        params = [p.detach().float() for p in model.parameters()]
        if self.ema is None:
            self.ema = [p.clone() for p in params]
        else:
            self.ema = [e * 0.9 + p * 0.1 for e, p in zip(self.ema, params)]


def _trainer_body(rank: int, world_size: int, tmp: str, stage: int) -> None:
    runs = {}
    for overlap in (False, True):
        out = f"{tmp}/overlap-{overlap}"
        ema = ParamEMA()
        args = make_args(
            out, stage, zero_overlap_allgather=overlap, eval_strategy="steps", eval_steps=2, save_strategy="steps",
            save_steps=3, max_steps=4,
        )  # fmt: skip
        data = dict(eval_dataset=torch.utils.data.Subset(TokenDataset(), range(8)))
        first = train(tiny_gpt2(), args, callbacks=[ema], **data)
        assert first.zero_optimizer.config.overlap_allgather is overlap
        resumed = train(tiny_gpt2(seed=5), make_args(out, stage, zero_overlap_allgather=overlap, max_steps=6,
                                                     eval_strategy="steps", eval_steps=2), resume=f"{out}/checkpoint-3",
                        callbacks=[ema], **data)  # fmt: skip
        runs[overlap] = (first, resumed, ema)
    (first_off, resumed_off, ema_off), (first_on, resumed_on, ema_on) = runs[False], runs[True]
    where = f"stage {stage}, W={world_size}, rank {rank}"
    for key in ("loss", "grad_norm"):
        assert logged(first_on, key) == logged(first_off, key), (where, key)
        assert logged(resumed_on, key) == logged(resumed_off, key), (where, key)
    evals = [[h["eval_loss"] for h in t.state.log_history if "eval_loss" in h] for t in (resumed_on, resumed_off)]
    assert evals[0] == evals[1] and evals[0], where
    assert all(torch.equal(a, b) for a, b in zip(ema_on.ema, ema_off.ema)), where
    for (name, p), q in zip(resumed_on.model.named_parameters(), resumed_off.model.parameters()):
        assert torch.equal(p, q), f"{where}: {name}"
    dist.barrier()


@pytest.mark.parametrize("world_size,stage", [(2, 2), slow((2, 1)), slow((3, 2))])  # each stage; an odd size
def test_the_trainer_with_overlap_gives_the_bits_of_overlap_off(tmp_path, world_size, stage):
    """Evaluation every 2 steps, a callback reading params after every step, a save at step 3 and a
    resume to step 6: losses, norms, evaluation losses, the callback's EMA and the final params
    equal, bit for bit."""
    run_distributed(_trainer_body, world_size, tmp=str(tmp_path), stage=stage)


def _compiled_body(rank: int, world_size: int, learned: bool) -> None:
    model = BranchyNet()
    opt = LowLevelZeroOptimizer(
        model, make_inner("adamw", model), stage=2, reduce_bucket_mb=0.0005, overlap_allgather=True
    )
    if learned:  # an eager forward first: the plan is learned before the model is compiled
        x, y = batch(rank, 0)
        opt.backward(mse_loss(model(x), y))
        opt.step()
    compiled = torch.compile(model, backend="eager")
    with pytest.raises(RuntimeError, match="overlap_allgather with torch.compile on the optimizer API"):
        compiled(batch(rank, 1)[0])


@pytest.mark.parametrize("learned", [False, True])
def test_torch_compile_with_overlap_is_refused_on_the_optimizer_api(learned):
    """The hooks that wait for the gathers would be traced (guards on what is in flight): refused with
    a clear error, whether or not an eager forward came first."""
    run_distributed(_compiled_body, 2, learned=learned)
