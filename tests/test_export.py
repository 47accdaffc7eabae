"""export_pretrained: a Trainer ``checkpoint-N`` folder becomes a ``from_pretrained`` directory with
full fp32 weights (ZeRO: the consolidated fp32 master rows, also for a bf16 run; stage 0: the
Trainer's own weights), a config that loads them as float32, and the tokenizer of the model the run
started from."""

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast

from hf_lowzero import consolidate_checkpoint
from hf_lowzero.consolidate import export_pretrained, read_weights
from hf_lowzero.testing import run_distributed
from tests.hf_models import tiny_gpt2
from tests.tiers import slow
from tests.trainer_runs import make_args, train


def train_body(rank, world_size, out, stage, bf16):
    args = make_args(out, stage, bf16=bf16, max_steps=2, save_strategy="steps", save_steps=2)
    train(tiny_gpt2(seed=1), args)


def trained_checkpoint(tmp_path, stage: int, bf16: bool):
    # In a process of its own: a Trainer that trained leaves state behind in this one (a process
    # group; accelerate's GradientState keeps weakrefs to its dataloaders, so no later Trainer of
    # this process pickles, as Ray Tune needs in tests/test_ray.py; the plain Trainer's too).
    run_distributed(train_body, 1, out=str(tmp_path / "run"), stage=stage, bf16=bf16)
    return tmp_path / "run" / "checkpoint-2"


@pytest.mark.parametrize("stage, bf16", [(2, True), slow((0, False))])
def test_export_loads_with_from_pretrained_and_holds_the_full_fp32_weights(tmp_path, stage, bf16):
    ckpt = trained_checkpoint(tmp_path, stage, bf16)
    # ZeRO: the fp32 master rows; stage 0: the Trainer's own (fp32) weights are complete.
    expected = consolidate_checkpoint(ckpt / "zero_optimizer") if stage else read_weights(ckpt)
    saved_dtype = next(iter(read_weights(ckpt).values())).dtype
    assert saved_dtype == (torch.bfloat16 if bf16 else torch.float32)

    model = AutoModelForCausalLM.from_pretrained(export_pretrained(ckpt, tmp_path / "export"))
    params = dict(model.named_parameters())
    assert set(params) == set(expected)
    for name, value in expected.items():
        assert params[name].dtype == torch.float32, name
        torch.testing.assert_close(params[name].detach(), value, rtol=0, atol=0, msg=name)
    assert not (tmp_path / "export" / "tokenizer_config.json").exists()  # the byte-level model has none


def test_export_takes_the_tokenizer_of_the_starting_model(tmp_path):
    vocab = {"[UNK]": 0, "zero": 1, "stage": 2}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]").save_pretrained(tmp_path / "base")
    out = export_pretrained(
        trained_checkpoint(tmp_path, 2, False), tmp_path / "export", tokenizer_from=tmp_path / "base"
    )
    assert AutoTokenizer.from_pretrained(out)("zero stage two")["input_ids"] == [1, 2, 0]


def test_export_refuses_a_folder_that_is_not_a_trainer_checkpoint(tmp_path):
    with pytest.raises(FileNotFoundError, match="expected a Trainer checkpoint-N folder"):
        export_pretrained(tmp_path, tmp_path / "export")
