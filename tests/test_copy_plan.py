"""A stop reuses its copy plan only while the shard keeps its tensors ([Note: copy plan]).

Two ranks train ``BranchyNet`` with ZeRO-2 and AdamW and stage a snapshot after each step. Every
staged copy must equal what ``shard_tensors`` reads from the live shard at that moment (the
reference: the stop without a plan): after in-place steps (the plan is reused), after a state
tensor was replaced by another object (AdamW's ``exp_avg`` of one param, as a load or another
optimizer may do), and after ``load_state_dict`` of an earlier state. The same holds for the bytes
a stop on the host writes from the live shard, without a copy ([Note: written from the live shard]).
"""

import torch
from torch.nn.functional import mse_loss

from hf_lowzero.checkpoint.save import shard_tensors
from hf_lowzero.checkpoint.shards import ShardView
from hf_lowzero.snapshot import ShardStager
from hf_lowzero.snapshot.file_layout import file_layout
from hf_lowzero.testing import run_distributed
from hf_lowzero.zero.optimizer import LowLevelZeroOptimizer
from tests.models import BranchyNet, make_inner


def _step(model, opt, rank: int, step: int) -> None:
    g = torch.Generator().manual_seed(100 * step + rank)
    loss = mse_loss(model(torch.randn(8, 17, generator=g)), torch.randn(8, 3, generator=g))
    loss.backward()
    opt.step()
    opt.zero_grad()


def _cloned(value):
    if isinstance(value, torch.Tensor):
        return value.clone()
    if isinstance(value, dict):
        return {k: _cloned(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_cloned(v) for v in value]
    return value


def _staged_equals_live(stager: ShardStager, opt, step: int) -> None:
    live, _ = shard_tensors(ShardView.of(opt), describe=False)
    staged = stager.stage(step)
    try:
        assert list(staged.shard) == list(live), f"step {step}: other tensors staged"
        for key, t in live.items():
            assert torch.equal(staged.shard[key], t), f"step {step}: {key} staged stale"
    finally:
        staged.release()
    # [Note: written from the live shard]: the bytes a stop on the host writes are the live shard's
    in_file_order = [live[key].reshape(-1).view(torch.uint8) for key, *_ in file_layout(live).spans]
    unstaged = stager.stage(step, live=True)
    assert unstaged.live is not None and list(unstaged.shard) == list(live)
    assert torch.equal(torch.cat(unstaged.live), torch.cat(in_file_order)), f"step {step}: stale bytes written"


def _plan_follows_the_shard(rank: int, world_size: int) -> None:
    model = BranchyNet()
    opt = LowLevelZeroOptimizer(model, make_inner("adamw", model), stage=2)
    stager = ShardStager(opt)
    _step(model, opt, rank, 0)
    saved = _cloned(opt.state_dict())  # its tensors are the live ones
    _staged_equals_live(stager, opt, 1)
    for step in (2, 3):  # in place: the same plan, the new values
        _step(model, opt, rank, step)
        plan = stager._plan
        _staged_equals_live(stager, opt, step)
        assert stager._plan is plan
    held = next(p for p in opt.optim.state if "exp_avg" in opt.optim.state[p])
    opt.optim.state[held]["exp_avg"] = opt.optim.state[held]["exp_avg"] + 1.0  # another tensor object
    _staged_equals_live(stager, opt, 4)
    opt.load_state_dict(saved)
    _staged_equals_live(stager, opt, 5)
    _step(model, opt, rank, 6)
    _staged_equals_live(stager, opt, 6)
    stager.close()


def test_a_stop_copies_the_live_shard_after_steps_a_replaced_tensor_and_a_load():
    run_distributed(_plan_follows_the_shard, 2)
