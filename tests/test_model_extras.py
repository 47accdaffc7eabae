"""Rank 0's stop reads the model's unsharded state from places found once ([Note: model extras]).

The reference is the walk itself (``unsharded_state`` and ``named_buffers``, what every stop did
before): after in-place updates and after a buffer was replaced by another tensor, the places give
the walk's answer; a new buffer, a removed one or a buffer made non-persistent makes a new walk; a
model with a state-dict hook is walked at every stop, while the overlapped all-gather's own state-dict
pre-hooks leave the places in use (reading them waits for no gather). Then, end to end, rank 0's staged copy of
the persistent buffers follows a buffer replaced between two snapshots and one registered later.
"""

import torch
from torch import nn
from torch.nn.functional import mse_loss

from hf_lowzero.checkpoint.shards import unsharded_state
from hf_lowzero.snapshot import ShardStager
from hf_lowzero.snapshot.model_extras import ModelExtras
from hf_lowzero.testing import run_distributed
from hf_lowzero.zero.optimizer import LowLevelZeroOptimizer
from hf_lowzero.zero.runtime.own_hooks import mark_own_hook
from tests.models import make_inner


class Normed(nn.Module):
    """Trainable layers, a batch norm with frozen affine params (persistent buffers and frozen
    params: both unsharded) and a non-persistent buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(6, 8)
        self.norm = nn.BatchNorm1d(8)
        self.norm.requires_grad_(False)
        self.out = nn.Linear(8, 3)
        self.register_buffer("scratch", torch.zeros(2), persistent=False)

    def forward(self, x):
        return self.out(self.norm(self.inp(x)))


def _managed(model):
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    return [p for _, p in named], [n for n, _ in named]


def _walk(model):
    params, names = _managed(model)
    walked = unsharded_state(model, params, names)
    return walked, {n for n, _ in model.named_buffers()} & set(walked)


def _same_as_walk(found: ModelExtras, model, when: str) -> None:
    walked, buffers = _walk(model)
    got = found.unsharded()
    assert sorted(got) == sorted(walked), f"{when}: entries {sorted(got)}, the walk {sorted(walked)}"
    for name, t in walked.items():
        assert got[name].data_ptr() == t.data_ptr() and torch.equal(got[name], t), f"{when}: {name} is not the live one"
    assert set(found.buffer_names) == buffers, f"{when}: buffers {sorted(found.buffer_names)}, walked {sorted(buffers)}"


def test_places_give_the_walks_answer_until_the_structure_changes():
    model = Normed()
    found = ModelExtras.of(model, *_managed(model))
    assert found.fingerprint is not None
    _same_as_walk(found, model, "first walk")
    assert "norm.running_mean" in found.buffer_names and "norm.weight" in found.unsharded()

    model(torch.randn(4, 6))  # running stats change in place
    assert found.fits(model)
    _same_as_walk(found, model, "in place")

    model.norm.running_var = torch.full((8,), 3.0)  # another tensor, the same place
    assert found.fits(model)
    _same_as_walk(found, model, "a replaced buffer")

    model.norm.register_buffer("extra_stat", torch.ones(8))
    assert not found.fits(model), "a new buffer kept the old places"
    found = ModelExtras.of(model, *_managed(model))
    _same_as_walk(found, model, "a new buffer")

    model.norm.register_buffer("extra_stat", torch.ones(8), persistent=False)
    assert not found.fits(model), "a buffer made non-persistent kept the old places"
    _same_as_walk(ModelExtras.of(model, *_managed(model)), model, "a non-persistent buffer")

    del model.norm.extra_stat
    assert not found.fits(model), "a removed buffer kept the old places"


def test_a_model_with_a_state_dict_hook_is_walked_every_time():
    model = Normed()

    def rename(module, state_dict, prefix, local_metadata):
        state_dict[prefix + "renamed_mean"] = state_dict.pop(prefix + "running_mean")

    model.norm._register_state_dict_hook(rename)
    found = ModelExtras.of(model, *_managed(model))
    assert found.fingerprint is None and not found.fits(model)
    _same_as_walk(found, model, "hooked")
    assert "norm.renamed_mean" in found.unsharded()


def _our_hooks_keep_the_places(rank: int, world_size: int) -> None:
    torch.manual_seed(0)
    model = Normed()
    opt = LowLevelZeroOptimizer(model, make_inner("adamw", model), stage=2, overlap_allgather=True)
    hooked = {name for name, m in model.named_modules() if m._state_dict_pre_hooks}
    assert {"", "inp", "out"} <= hooked, f"the all-gather's state-dict pre-hooks are on {sorted(hooked)}"
    found = ModelExtras.of(model, *_managed(model))
    assert found.fingerprint is not None and found.fits(model), "our own hooks made every stop walk the model"
    gather = opt._parts.gather
    for step in range(2):
        mse_loss(model(torch.randn(8, 6)), torch.randn(8, 3)).backward()
        opt.step()
        opt.zero_grad()
        assert len(gather.pending) == len(opt.buckets), f"step {step}: the gathers are not in flight"
        assert found.fits(model), f"step {step}: the places were dropped"
        unsharded = found.unsharded()
        assert len(gather.pending) == len(opt.buckets), f"step {step}: reading the places waited for the gathers"
        assert sorted(unsharded) == ["norm.bias", "norm.num_batches_tracked", "norm.running_mean",
                                     "norm.running_var", "norm.weight"]  # fmt: skip
    _same_as_walk(found, model, "with our hooks")

    model.norm.register_state_dict_pre_hook(lambda module, prefix, keep_vars: None)  # a user's hook
    assert not found.fits(model), "a user's state-dict hook kept the places"
    assert ModelExtras.of(model, *_managed(model)).fingerprint is None, "a user's hook is not walked every time"


def test_a_hook_marked_ours_keeps_the_places():
    model = Normed()
    waited = []
    ours = mark_own_hook(lambda module, prefix, keep_vars: waited.append(prefix))  # changes no entry
    handles = [m.register_state_dict_pre_hook(ours) for m in (model, model.inp, model.norm)]
    handles.append(model.norm.register_load_state_dict_pre_hook(ours))  # stored wrapped by torch
    found = ModelExtras.of(model, *_managed(model))
    assert found.fingerprint is not None and found.fits(model)
    assert waited == ["", "inp.", "norm."], "the first walk runs the hooks"
    _same_as_walk(found, model, "marked hooks")
    waited.clear()
    found.unsharded()
    assert waited == [], "reading the places ran the hooks"
    for handle in handles:
        handle.remove()
    assert found.fits(model), "removing our hooks dropped the places"
    model.inp.register_state_dict_pre_hook(lambda module, prefix, keep_vars: None)  # the same, not marked
    assert not found.fits(model)


def test_our_own_state_dict_hooks_keep_the_places_and_a_users_hook_does_not():
    run_distributed(_our_hooks_keep_the_places, 2)


def _staged_buffers_follow_the_model(rank: int, world_size: int) -> None:
    torch.manual_seed(0)  # the same replicas
    model = Normed()
    opt = LowLevelZeroOptimizer(model, make_inner("adamw", model), stage=2)
    stager = ShardStager(opt)
    for step in range(1, 5):
        g = torch.Generator().manual_seed(step)  # the same batch: batch norm stats alike on every replica
        mse_loss(model(torch.randn(8, 6, generator=g)), torch.randn(8, 3, generator=g)).backward()
        opt.step()
        opt.zero_grad()
        if step == 3:
            model.norm.running_mean = torch.full((8,), float(step))  # replaced between two snapshots
            model.register_buffer("late", torch.arange(4.0))  # and one registered later
        staged = stager.stage(step)
        try:
            if rank != 0:
                assert staged.extras == {}, "only rank 0's piece holds the buffers"
                continue
            _, buffers = _walk(model)
            live = dict(model.state_dict())
            assert sorted(staged.extras) == sorted(f"extra/{n}" for n in buffers), f"step {step}: other buffers"
            for name in buffers:
                assert torch.equal(staged.extras[f"extra/{name}"], live[name]), f"step {step}: {name} staged stale"
        finally:
            staged.release()
    stager.close()


def test_rank0s_staged_buffers_follow_a_replaced_buffer_and_a_new_one():
    run_distributed(_staged_buffers_follow_the_model, 2)
