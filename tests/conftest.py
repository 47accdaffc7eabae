import datetime
import os

import pytest
import torch.distributed as dist
from transformers import GPT2Config, GPT2LMHeadModel

from hf_lowzero.recipes.clm import DEFAULT_CORPUS
from hf_lowzero.testing import preload
from tests import ray_env

# Every forward with the all-gathers in flight is watched: a read of a param before its gather lands
# raises, naming the param and the module ([Note: every read waits] in hf_lowzero/zero/reads/plan.py).
os.environ.setdefault("HF_LOWZERO_CHECK_PARAM_READS", "1")
ray_env.apply()  # what the Ray runs here need not pay for (tests/ray_env.py)

# What most ranks of the distributed tests import: once, in the fork server ([Note: ranks from a fork
# server] in hf_lowzero/testing.py), not in every rank.
preload("transformers", "hf_lowzero.trainer", "tests.models", "tests.hf_models", "tests.trainer_runs")


@pytest.fixture
def single_rank_group(tmp_path):
    """A world of size 1 (gloo) inside the test process itself, for validation tests."""
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1, timeout=datetime.timedelta(seconds=60))
    yield
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def no_dropout_model(tmp_path_factory) -> tuple[str, str]:
    """A tiny GPT-2 without dropout (so losses depend on the data only) and a corpus of exactly
    128 blocks of 64 bytes: 16 steps of 8 sequences, no epoch boundary within the run."""
    root = tmp_path_factory.mktemp("elastic_model")
    config = GPT2Config(vocab_size=257, n_positions=128, n_embd=64, n_layer=2, n_head=4, bos_token_id=256,
                        eos_token_id=256, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)  # fmt: skip
    GPT2LMHeadModel(config).save_pretrained(root / "model")
    text = "".join(c for c in DEFAULT_CORPUS.read_text() if c.isascii())
    (root / "corpus.txt").write_text((text * (8192 // len(text) + 1))[:8192])
    return str(root / "model"), str(root / "corpus.txt")
