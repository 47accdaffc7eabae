"""A save cut at any point is never taken for a good checkpoint: the error names what is left and
how to restore it, the next save loses nothing, and a Trainer resume skips (or refuses) the cut
``checkpoint-N`` for the last complete one. Cuts come from ``HF_LOWZERO_CRASH_POINT``
(``checkpoint/save.py``): the process dies there, as a killed worker would."""

import logging
import os

import pytest
import torch
from torch.multiprocessing import ProcessExitedException
from transformers import TrainerCallback

from hf_lowzero import CheckpointError, consolidate_checkpoint, load_checkpoint, save_checkpoint
from hf_lowzero.checkpoint.save import CRASH_POINT_ENV
from hf_lowzero.testing import run_distributed
from tests.hf_models import tiny_gpt2
from tests.test_checkpoint import build, train
from tests.trainer_runs import make_args
from tests.trainer_runs import train as trainer_train


def cut_between_renames_body(rank, world_size, tmp):
    model, opt = build(1, torch.float32)
    train(model, opt, rank, world_size, range(1), torch.float32)
    save_checkpoint(opt, f"{tmp}/ck")
    torch.save({n: p.detach().clone() for n, p in model.named_parameters()}, f"{tmp}/first.pt")
    train(model, opt, rank, world_size, range(1, 2), torch.float32)
    torch.save({n: p.detach().clone() for n, p in model.named_parameters()}, f"{tmp}/second.pt")
    os.environ[CRASH_POINT_ENV] = "between_renames"
    save_checkpoint(opt, f"{tmp}/ck")


def next_save_body(rank, world_size, tmp):
    model, opt = build(1, torch.float32, seed=3)
    load_checkpoint(opt, f"{tmp}/ck.partial")  # the complete copy loads as it is
    saved = torch.load(f"{tmp}/second.pt")
    assert all(torch.equal(p, saved[n]) for n, p in model.named_parameters())
    train(model, opt, rank, world_size, range(2, 3), torch.float32)
    os.environ[CRASH_POINT_ENV] = "after_rank_files"  # the next save is cut too
    save_checkpoint(opt, f"{tmp}/ck")


def test_a_cut_between_the_renames_is_named_truthfully_and_the_next_save_loses_nothing(tmp_path):
    with pytest.raises(ProcessExitedException, match="exit code 17"):
        run_distributed(cut_between_renames_body, 1, tmp=str(tmp_path))
    ck, old, partial = tmp_path / "ck", tmp_path / "ck.old", tmp_path / "ck.partial"
    assert not ck.exists() and old.is_dir() and (partial / "zero_meta.json").is_file()
    message = (
        f"{ck}/zero_meta.json: missing; not a complete hf_lowzero checkpoint. A save was cut between its last "
        f"renames: {partial} holds the complete new checkpoint, and {old} the previous one. Restore it with: "
        f"mv {partial} {ck}"
    )
    with pytest.raises(CheckpointError) as raised:
        consolidate_checkpoint(ck)
    assert str(raised.value) == message

    def assert_holds(folder, expected):
        weights = consolidate_checkpoint(folder)
        assert all(torch.equal(weights[n], v) for n, v in torch.load(tmp_path / expected).items()), folder

    assert_holds(old, "first.pt")  # both copies hold what the message says
    assert_holds(partial, "second.pt")
    with pytest.raises(ProcessExitedException, match="exit code 17"):
        run_distributed(next_save_body, 1, tmp=str(tmp_path))
    assert_holds(ck, "second.pt")  # the next save finished the swap first: cut again, it lost nothing
    assert_holds(old, "first.pt")


class CrashAtStep(TrainerCallback):
    """Arms the crash point once step ``step`` is done: the save of ``checkpoint-<step>`` is cut."""

    def __init__(self, step: int, point: str) -> None:
        self.step, self.point = step, point

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            os.environ[CRASH_POINT_ENV] = self.point


def cut_trainer_body(rank, world_size, out, point):
    args = make_args(out, 2, max_steps=4, save_strategy="steps", save_steps=2)
    trainer_train(tiny_gpt2(seed=0), args, callbacks=[CrashAtStep(4, point)])


def uninterrupted_body(rank, world_size, out):
    trainer = trainer_train(tiny_gpt2(seed=0), make_args(out, 2, max_steps=4))
    if rank == 0:
        torch.save({n: p.detach().clone() for n, p in trainer.model.named_parameters()}, f"{out}/final.pt")


def resume_body(rank, world_size, out, reference):
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logging.getLogger("hf_lowzero.trainer.resume").addHandler(handler)
    args = make_args(out, 2, max_steps=4, save_strategy="no")
    with pytest.raises(
        ValueError, match=f"cannot resume from {out}/checkpoint-4: .*resume_from_checkpoint='{out}/checkpoint-2'"
    ):
        trainer_train(tiny_gpt2(seed=5), args, resume=f"{out}/checkpoint-4")
    trainer = trainer_train(tiny_gpt2(seed=5), args, resume=True)
    lines = [r.getMessage() for r in records]
    assert len(lines) == 1 and lines[0].startswith(f"resuming from {out}/checkpoint-2: skipped incomplete checkpoint-4")
    assert [h["step"] for h in trainer.state.log_history if "loss" in h] == [1, 2, 3, 4]  # 1-2 from checkpoint-2
    final = torch.load(reference)
    for n, p in trainer.model.named_parameters():  # checkpoint-2's optimizer and schedule, as if never cut
        torch.testing.assert_close(p, final[n], rtol=0, atol=1e-6, msg=n)


@pytest.mark.parametrize("point", ["after_rank_files", "between_renames"])
def test_a_cut_trainer_save_is_skipped_for_the_last_complete_checkpoint(tmp_path, point):
    run_distributed(uninterrupted_body, 2, out=str(tmp_path / "whole"))
    out = tmp_path / "cut"
    with pytest.raises(ProcessExitedException, match="exit code 17"):
        run_distributed(cut_trainer_body, 2, out=str(out), point=point)
    cut = out / "checkpoint-4"
    assert (cut / "zero_optimizer.partial").is_dir() and not (cut / "trainer_state.json").exists()
    run_distributed(resume_body, 2, out=str(out), reference=str(tmp_path / "whole" / "final.pt"))
    assert (cut / "zero_optimizer.partial").is_dir()  # skipped and refused, never deleted
