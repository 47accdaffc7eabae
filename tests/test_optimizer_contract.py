"""The torch.optim contract that user code, LR schedulers and Trainer rely on: param groups of the
model's own params, torch-format state dicts that restore a rank exactly, recovery from an
exception in backward, and a clear error when the model is cast after wrapping."""

import contextlib
import copy

import pytest
import torch
from torch.nn.functional import mse_loss

from hf_lowzero import LowLevelZeroOptimizer
from hf_lowzero.testing import run_distributed
from hf_lowzero.zero.runtime.comm import comm_stats
from tests.models import BranchyNet, batch, make_inner
from tests.tiers import slow

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def build(stage, dtype=torch.float32, seed=0, inner="adamw"):
    model = BranchyNet(seed).to(dtype)
    fp16 = {"initial_scale": 2.0**10, "growth_interval": 2} if dtype is torch.float16 else {}
    opt = LowLevelZeroOptimizer(
        model, make_inner(inner, model), stage=stage, reduce_bucket_mb=0.0005, clip_grad_norm=0.5, **fp16
    )
    return model, opt


def micro_backward(model, opt, rank, step, micro, micro_batches, dtype=torch.float32, direct=False):
    """One micro-batch; stage 1 accumulates the non-final ones under no_sync(), as Trainer does."""
    x, y = (t.to(dtype) for t in batch(rank, step, micro))
    local = opt.no_sync() if opt.config.stage == 1 and micro < micro_batches - 1 else contextlib.nullcontext()
    with local:
        loss = mse_loss(model(x, (rank + step) % 2 == 0), y) / micro_batches
        loss.backward() if direct else opt.backward(loss)


def train_step(model, opt, rank, step, dtype=torch.float32, micro_batches=1, direct=False):
    for micro in range(micro_batches):
        micro_backward(model, opt, rank, step, micro, micro_batches, dtype, direct)
    applied = opt.step()
    opt.zero_grad()
    return applied


def params_of(model):
    return [p.detach().clone() for p in model.parameters()]


def assert_identical(a, b, where):
    for i, (p, q) in enumerate(zip(a, b)):
        assert torch.equal(p, q), f"{where}: param {i} differs by {(p.float() - q.float()).abs().max()}"


# ------------------------------------------------------------------------------ param groups


def param_groups_case(rank, stage):
    model, opt = build(stage)
    inner_groups = make_inner("adamw", BranchyNet())  # the same grouping, over another model
    trainable = [p for p in model.parameters() if p.requires_grad]
    # The model's own params, in the inner optimizer's groups and order, with its hyperparameters.
    assert [len(g["params"]) for g in opt.param_groups] == [len(g["params"]) for g in inner_groups.param_groups]
    assert {id(p) for g in opt.param_groups for p in g["params"]} == {id(p) for p in trainable}
    for ours, theirs in zip(opt.param_groups, inner_groups.param_groups):
        assert [tuple(p.shape) for p in ours["params"]] == [tuple(p.shape) for p in theirs["params"]]
        assert ours["params"][0] in ours["params"]  # `param in group["params"]`, as Trainer.get_optimizer_group
    assert opt.param_groups[1]["lr"] == 0.5 * opt.param_groups[0]["lr"]
    assert all(g["params"][0].dim() == 1 and g["params"][0].dtype is torch.float32 for g in opt.optim.param_groups)

    # Hyperparameters set on opt.param_groups reach the inner optimizer before every step: a
    # frozen-by-lr group does not move (AdamW with lr=0 and weight decay changes nothing).
    ref = copy.deepcopy(model)
    ref_opt = make_inner("adamw", ref)
    opt.param_groups[0]["lr"] = 0.0
    opt.param_groups[1]["weight_decay"] = 0.3
    ref_opt.param_groups[0]["lr"] = 0.0
    ref_opt.param_groups[1]["weight_decay"] = 0.3
    before = {id(p): p.detach().clone() for p in opt.param_groups[0]["params"]}
    for step in range(2):
        train_step(model, opt, rank, step)
    assert all(torch.equal(p, before[id(p)]) for p in opt.param_groups[0]["params"])
    assert opt.optim.param_groups[1]["weight_decay"] == 0.3
    assert any(not torch.equal(p, q) for p, q in zip(model.parameters(), ref.parameters()))  # group 1 trained
    assert set(opt.state) <= set(trainable) and all("exp_avg" in s for s in opt.state.values())

    # A scheduler built on the inner optimizer before wrapping (or handed to Trainer with it in
    # optimizers=) drives the same learning rates as one built on the ZeRO optimizer.
    runs = []
    for bind_to_inner in (True, False):
        model = BranchyNet()
        inner = make_inner("adamw", model)
        scheduler = torch.optim.lr_scheduler.LambdaLR(inner, lambda s: 0.5**s) if bind_to_inner else None
        opt = LowLevelZeroOptimizer(model, inner, stage=stage)
        scheduler = scheduler or torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5**s)
        for step in range(3):
            train_step(model, opt, rank, step)
            scheduler.step()
        assert opt.param_groups[1]["lr"] == inner.param_groups[1]["lr"] == 0.5 * 1e-2 * 0.5**3
        runs.append(params_of(model))
    assert_identical(runs[0], runs[1], "scheduler on the inner optimizer")


# ------------------------------------------------------------------------------- state dicts


def state_dict_case(rank, world_size, stage, dtype):
    where = f"stage {stage} {dtype}"
    model, opt = build(stage, dtype)
    for step in range(3):
        train_step(model, opt, rank, step, dtype)
    sd = opt.state_dict()
    assert set(sd) == {"state", "param_groups", "zero"}
    n = len(opt.managed_params)
    assert [p for g in sd["param_groups"] for p in g["params"]] == list(range(n))
    assert set(sd["state"]) <= set(range(n)) and all("exp_avg" in s for s in sd["state"].values())
    assert sd["param_groups"][0]["lr"] == opt.param_groups[0]["lr"]
    assert sd["zero"]["rank"] == rank and sd["zero"]["world_size"] == world_size
    saved = copy.deepcopy(sd), copy.deepcopy(model.state_dict())

    for step in range(3, 6):
        train_step(model, opt, rank, step, dtype)
    uninterrupted = params_of(model), opt.loss_scale, opt.skipped_steps

    restored, restored_opt = build(stage, dtype, seed=11)  # everything must come from the state dicts
    restored.load_state_dict(saved[1])
    restored_opt.load_state_dict(saved[0])
    for step in range(3, 6):
        train_step(restored, restored_opt, rank, step, dtype)
    assert_identical(params_of(restored), uninterrupted[0], where)
    assert (restored_opt.loss_scale, restored_opt.skipped_steps) == uninterrupted[1:], where


def bad_state_dicts_case(rank, world_size):
    model, opt = build(2)
    train_step(model, opt, rank, 0)
    good = copy.deepcopy(opt.state_dict())
    other_rank = copy.deepcopy(good)
    other_rank["zero"]["rank"] = (rank + 1) % world_size
    wrong_row = copy.deepcopy(good)
    wrong_row["zero"]["master_rows"][0] = torch.zeros(3)
    plain = make_inner("adamw", BranchyNet()).state_dict()
    before = copy.deepcopy(opt.state_dict())
    cases = [
        (plain, "not a LowLevelZeroOptimizer state dict"),
        (other_rank, "restores the same rank at the same world size"),
        (wrong_row, "master row 0 has shape"),
    ]
    if world_size == 1:
        cases = cases[:1] + cases[2:]
    for bad, message in cases:
        with pytest.raises(ValueError, match=message):
            opt.load_state_dict(bad)
        now = opt.state_dict()
        assert all(torch.equal(before["zero"]["master_rows"][k], v) for k, v in now["zero"]["master_rows"].items())
        assert all(torch.equal(before["state"][k]["exp_avg"], v["exp_avg"]) for k, v in now["state"].items())


# --------------------------------------------------------------------- failure in backward


class FailOnce:
    """Raises inside backward (at the output of ``frozen``, after the head's buckets launched)
    at the chosen micro-batch of the chosen step, on every rank."""

    def __init__(self, model, step, micro, early=False):
        self.calls, self.at = 0, (step, micro)
        self.step = self.micro = 0
        layer = model.head if early else model.frozen
        layer.register_forward_hook(self.on_forward)

    def on_forward(self, module, inputs, out):
        out.register_hook(self.maybe_raise)

    def maybe_raise(self, grad):
        if (self.step, self.micro) == self.at:
            raise torch.OutOfMemoryError("injected OOM in backward")
        return grad


def failure_case(rank, stage, micro_batches, direct, early):
    where = f"stage {stage} micro {micro_batches} direct {direct} early {early}"
    fail_step = 1
    model, opt = build(stage)
    fail = FailOnce(model, fail_step, micro_batches - 1, early)
    ref_model, ref_opt = build(stage)
    steps = 4
    for step in range(steps):
        fail.step = step
        if step == fail_step:
            with pytest.raises(torch.OutOfMemoryError):
                for micro in range(micro_batches):
                    fail.micro = micro
                    micro_backward(model, opt, rank, step, micro, micro_batches, direct=direct)
            if not early:
                with pytest.raises(RuntimeError, match="Call optimizer.zero_grad"):
                    opt.step()
            opt.zero_grad()
            continue  # the reference never sees this step's batches
        fail.micro = -1
        train_step(model, opt, rank, step, micro_batches=micro_batches, direct=direct)
        train_step(ref_model, ref_opt, rank, step, micro_batches=micro_batches, direct=direct)
        assert_identical(params_of(model), params_of(ref_model), f"{where} step {step}")


# -------------------------------------------------------------------- cast after wrapping


def cast_after_wrap_case(rank, stage):
    for change, message in [
        (lambda m: m.half(), "dtype changed from torch.float32 to torch.float16"),
        (lambda m: setattr(m.head.weight, "data", m.head.weight.data.clone()), "storage was replaced"),
    ]:
        model, opt = build(stage)
        train_step(model, opt, rank, 0)
        change(model)
        before = params_of(model)
        comm_stats.reset()
        x, y = (t.to(model.head.weight.dtype) for t in batch(rank, 1))
        with pytest.raises(RuntimeError, match=message):
            opt.backward(mse_loss(model(x), y))
        with pytest.raises(RuntimeError, match="cast or move the model first"):
            mse_loss(model(x), y).backward()  # the direct path: refused at the first hook
        with pytest.raises(RuntimeError, match=message):
            opt.step()
        assert sum(comm_stats.calls.values()) == 0, "nothing may be reduced"
        assert_identical(params_of(model), before, "nothing may be updated")


def contract_body(rank, world_size):
    for stage in (1, 2):
        param_groups_case(rank, stage)
        for dtype in DTYPES:
            state_dict_case(rank, world_size, stage, dtype)
        for micro_batches, direct, early in [(1, False, False), (2, True, False), (3, False, True), (1, True, True)]:
            failure_case(rank, stage, micro_batches, direct, early)
        cast_after_wrap_case(rank, stage)
    bad_state_dicts_case(rank, world_size)


@pytest.mark.parametrize("world_size", [1, 2, slow(3)])
def test_optimizer_contract(world_size):
    run_distributed(contract_body, world_size)


def test_chained_optimizer_is_one_torch_optimizer(single_rank_group):
    """Muon for matrices and AdamW for the rest behave, saved and restored, as the two side by side;
    under ZeRO the chain gets whole params (Muon needs whole matrices)."""
    from hf_lowzero import ChainedOptimizer

    def build(seed):
        torch.manual_seed(seed)
        model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
        matrices = [p for p in model.parameters() if p.ndim == 2]
        rest = [p for p in model.parameters() if p.ndim != 2]
        return model, ChainedOptimizer(torch.optim.Muon(matrices, lr=0.02), torch.optim.AdamW(rest, lr=1e-2))

    def step(model, opt, i):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(i))
        model(x).square().sum().backward()
        opt.step()
        opt.zero_grad()

    model, chain = build(0)
    for i in range(2):
        step(model, chain, i)
    saved = chain.state_dict()
    assert sorted(saved["state"]) == [0, 1, 2, 3] and [g["params"] for g in saved["param_groups"]] == [[0, 1], [2, 3]]
    twin, twin_chain = build(1)
    twin.load_state_dict(model.state_dict())
    twin_chain.load_state_dict(copy.deepcopy(saved))  # as torch.save + torch.load would give it
    for i in range(2, 4):
        step(model, chain, i)
        step(twin, twin_chain, i)
    for p, q in zip(model.parameters(), twin.parameters()):
        assert torch.equal(p, q)
    with pytest.raises(ValueError, match="share a param"):
        ChainedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), torch.optim.SGD(model.parameters(), lr=0.1))
    fresh, fresh_chain = build(2)
    assert LowLevelZeroOptimizer(fresh, fresh_chain).partition == "params"


def test_inner_optimizer_attributes_are_reachable(single_rank_group):
    """What code reads off the optimizer Trainer built (bitsandbytes' ``mng``, settings of its own)
    reads through to the inner optimizer; private names and missing ones are AttributeErrors."""
    model = torch.nn.Linear(4, 4)
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    inner.custom_setting = 3
    opt = LowLevelZeroOptimizer(model, inner)
    assert opt.custom_setting == 3
    with pytest.raises(AttributeError, match="no attribute 'missing'"):
        assert opt.missing is None  # raises first
    with pytest.raises(AttributeError):
        assert opt._private_thing is None  # raises first


@pytest.mark.parametrize("stage", [1, 2])
def test_a_dropped_optimizer_frees_its_model_and_state(single_rank_group, stage):
    """An optimizer and its model, once nothing refers to them, are freed by Python's collector
    ([Note: hooks hold the optimizer weakly] in zero/grads/backward.py), also one dropped between its
    backward and its step (a probe that ran out of memory in the step). Before, the bucket hooks
    made a cycle through the params that the collector never freed: every optimizer stayed for the
    process's life."""
    import gc
    import weakref

    def train_and_drop(step: bool) -> list[weakref.ref]:
        model = BranchyNet()
        opt = LowLevelZeroOptimizer(model, make_inner("adamw", model), stage=stage, reduce_bucket_mb=0.001)
        x, y = batch(0, 0)
        opt.backward(mse_loss(model(x), y))
        if step:
            opt.step()
        return [weakref.ref(t) for t in (*model.parameters(), opt.master.flat)]

    for step in (True, False):
        refs = train_and_drop(step)
        gc.collect()
        alive = [r for r in refs if r() is not None]
        assert not alive, f"{len(alive)} of {len(refs)} tensors outlived their optimizer (step={step})"
