"""Bad input gets a clear error, raised before anything is changed."""

import pytest
import torch
from torch import nn

from hf_lowzero import LowLevelZeroOptimizer, ZeroConfig
from tests.models import BranchyNet, make_inner


def groups_snapshot(opt):
    return [[id(p) for p in g["params"]] for g in opt.param_groups]


def test_needs_an_initialized_process_group():
    model = nn.Linear(3, 3)
    with pytest.raises(RuntimeError, match="init_process_group"):
        LowLevelZeroOptimizer(model, torch.optim.SGD(model.parameters(), lr=0.1))


@pytest.mark.parametrize("cls", [torch.optim.Adafactor, torch.optim.Muon])
def test_whole_tensor_optimizers_are_refused_on_rows(single_rank_group, cls):
    model = nn.Linear(8, 8, bias=False)
    inner = cls(model.parameters(), lr=0.01)
    before = groups_snapshot(inner)
    with pytest.raises(ValueError, match="wrong on the row shards.*partition='params'"):
        LowLevelZeroOptimizer(model, inner, partition="rows")
    assert groups_snapshot(inner) == before  # untouched
    assert LowLevelZeroOptimizer(model, inner).partition == "params"  # what "auto" picks for them


@pytest.mark.parametrize("partition", ["auto", "rows", "params"])
@pytest.mark.parametrize(
    "cls,kwargs,why",
    [(torch.optim.LBFGS, {}, "needs a closure"), (torch.optim.SparseAdam, {"lr": 0.01}, "needs sparse gradients")],
)
def test_optimizers_zero_cannot_step_are_refused_when_built(single_rank_group, cls, kwargs, why, partition):
    model = nn.Linear(8, 8, bias=False)
    inner = cls(model.parameters(), **kwargs)
    before = groups_snapshot(inner)
    with pytest.raises(ValueError, match=f"{cls.__name__} cannot run under ZeRO: .*{why}.*Use another optimizer"):
        LowLevelZeroOptimizer(model, inner, partition=partition)
    assert groups_snapshot(inner) == before and not inner.state  # untouched
    assert not any(p._post_accumulate_grad_hooks for p in model.parameters())  # no hooks left behind


def test_unknown_optimizer_gets_whole_params_or_rows_when_vouched_for(single_rank_group):
    class SignSGD(torch.optim.Optimizer):
        def __init__(self, params, lr):
            super().__init__(params, {"lr": lr})

        @torch.no_grad()
        def step(self, closure=None):
            for g in self.param_groups:
                for p in g["params"]:
                    if p.grad is not None:
                        p.add_(p.grad.sign(), alpha=-g["lr"])

    model = nn.Linear(4, 4)
    with pytest.raises(ValueError, match="allow_untested_optimizer=True"):
        LowLevelZeroOptimizer(model, SignSGD(model.parameters(), lr=0.1), partition="rows")
    whole = LowLevelZeroOptimizer(model, SignSGD(model.parameters(), lr=0.1))
    assert whole.partition == "params"
    whole.remove_hooks()
    opt = LowLevelZeroOptimizer(model, SignSGD(model.parameters(), lr=0.1), allow_untested_optimizer=True)
    assert opt.partition == "rows"
    before = model.weight.detach().clone()
    opt.backward(model(torch.ones(2, 4)).sum())
    opt.step()
    torch.testing.assert_close(model.weight, before - 0.1)  # d(sum)/dW = 2 > 0 everywhere


def test_already_stepped_optimizer_is_refused(single_rank_group):
    model = nn.Linear(4, 4)
    inner = torch.optim.Adam(model.parameters())
    model(torch.ones(1, 4)).sum().backward()
    inner.step()
    with pytest.raises(ValueError, match="already has state"):
        LowLevelZeroOptimizer(model, inner)


@pytest.mark.parametrize("overrides,match", [({"stage": 3}, "stage"), ({"reduce_bucket_mb": 0}, "reduce_bucket_mb")])
def test_invalid_config_through_overrides(single_rank_group, overrides, match):
    model = nn.Linear(4, 4)
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match=match):
        LowLevelZeroOptimizer(model, inner, **overrides)
    with pytest.raises(ValueError, match=match):
        LowLevelZeroOptimizer(model, inner, ZeroConfig(stage=1).with_overrides(**overrides))


def test_optimizer_must_hold_exactly_the_models_trainable_params(single_rank_group):
    model, other = BranchyNet(), nn.Linear(4, 4)
    trainable = [p for p in model.parameters() if p.requires_grad]
    with pytest.raises(ValueError, match="not a parameter of the model"):
        LowLevelZeroOptimizer(model, torch.optim.SGD(trainable + list(other.parameters()), lr=0.1))
    with pytest.raises(ValueError, match="not in the optimizer"):
        LowLevelZeroOptimizer(model, torch.optim.SGD(trainable[1:], lr=0.1))
    with pytest.raises(ValueError, match="requires_grad=False"):
        LowLevelZeroOptimizer(model, torch.optim.SGD(model.parameters(), lr=0.1))  # includes `frozen`
    assert all(p.grad is None for p in model.parameters())
    assert not any(p._post_accumulate_grad_hooks for p in model.parameters())  # no hooks left behind


def test_no_sync_under_stage2_says_why(single_rank_group):
    model = BranchyNet()
    opt = LowLevelZeroOptimizer(model, make_inner("adamw", model), stage=2)
    with pytest.raises(RuntimeError, match="not available with ZeRO stage 2"), opt.no_sync():
        pass
    with pytest.raises(TypeError, match="closure"):
        opt.step(closure=lambda: 0.0)
    with pytest.raises(RuntimeError, match="static"):
        opt.add_param_group({"params": [nn.Parameter(torch.ones(2))]})


def test_wrapping_twice_is_refused(single_rank_group):
    model = nn.Linear(4, 4)
    opt = LowLevelZeroOptimizer(model, torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(TypeError, match="already a LowLevelZeroOptimizer"):
        LowLevelZeroOptimizer(model, opt)
