"""Every way a model reads its params, with the all-gather left in flight (issue 54, must-hold 5).

[Note: overlapped all-gather] in zero/update/allgather.py: after ``step()`` each bucket's gather is
in flight until something waits for it. A read that bypasses the forward of the module holding the
param must still see the updated value: ``nn.MultiheadAttention`` hands ``out_proj``'s weight and
bias to ``F.multi_head_attention_forward`` without calling ``out_proj``; the eval fast paths of
``nn.TransformerEncoderLayer`` and ``nn.MultiheadAttention`` (eval and no_grad) read every weight
themselves; ``torch.nn.utils.prune`` and the old ``torch.nn.utils.weight_norm`` compute the weight
in a forward pre-hook registered before the optimizer's. The zoo, at W=2, stage 2, buckets small
enough to cut inside every layer: overlap on must give the bits of overlap off, in the training
losses, in an evaluation right after each step (no ``wait_for_params()`` before it) and in the final
params, and the optimizer's stale-read error must not fire.
"""

from __future__ import annotations

import contextlib
import warnings

import pytest
import torch
from torch import nn
from torch.nn.functional import mse_loss
from torch.nn.utils import parametrizations, prune
from transformers import LlamaConfig, LlamaForCausalLM, T5Config, T5ForConditionalGeneration

from hf_lowzero import LowLevelZeroOptimizer, ZeroConfig
from hf_lowzero.testing import run_distributed
from tests.hf_models import VOCAB, tiny_bert, tiny_gpt2
from tests.models import batch

STEPS = 4
BUCKET_MB = 0.0005  # 131 fp32 elements: every weight a bucket of its own, biases a few to a bucket
WIDTH = 16


def tiny_llama() -> LlamaForCausalLM:
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=37, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32)  # fmt: skip
    return LlamaForCausalLM(config)


def tiny_t5() -> T5ForConditionalGeneration:
    config = T5Config(vocab_size=VOCAB, d_model=32, d_kv=16, d_ff=37, num_layers=2, num_heads=2,
                      relative_attention_num_buckets=8, dropout_rate=0.0, decoder_start_token_id=0)  # fmt: skip
    return T5ForConditionalGeneration(config)


class EncoderNet(nn.Module):
    """``nn.TransformerEncoder`` with ``batch_first``: eval under no_grad takes the fused fast path
    (``torch._transformer_encoder_layer_fwd``) when no forward hook is attached inside a layer.
    On CPU it gives the slow path's bits (checked for 20 seeds): a comparison of the evaluations
    holds whichever path the optimizer's hooks leave."""

    def __init__(self) -> None:
        super().__init__()
        layer = nn.TransformerEncoderLayer(WIDTH, 2, 32, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(WIDTH, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(x).mean(1))


def _with_hooked_first_layer(first: nn.Module) -> nn.Sequential:
    return nn.Sequential(first, nn.Tanh(), nn.Linear(33, 3))


def pruned() -> nn.Sequential:
    """A Linear pruned before wrapping: prune's pre-hook computes ``weight`` from ``weight_orig``."""
    model = _with_hooked_first_layer(nn.Linear(17, 33))
    prune.l1_unstructured(model[0], "weight", amount=0.3)
    return model


def weight_norm_parametrized() -> nn.Sequential:
    return _with_hooked_first_layer(parametrizations.weight_norm(nn.Linear(17, 33)))


def weight_norm_hooked() -> nn.Sequential:
    """The old ``weight_norm``: a forward pre-hook computes ``weight`` from ``weight_g`` and ``weight_v``."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # deprecated for the parametrization
        return _with_hooked_first_layer(torch.nn.utils.weight_norm(nn.Linear(17, 33)))


def _tokens(rank: int, step: int, shape=(4, 12), high: int = VOCAB) -> torch.Tensor:
    return torch.randint(0, high, shape, generator=torch.Generator().manual_seed(1000 * rank + 17 * step))


def _sequences(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * rank + 17 * step)
    return torch.randn(4, 9, WIDTH, generator=g), torch.randn(4, 9, WIDTH, generator=g)


def _clm(model, rank, step):
    ids = _tokens(rank, step)
    return model(input_ids=ids, labels=ids).loss


def _classify(model, rank, step):
    ids = _tokens(rank, step)
    return model(input_ids=ids, attention_mask=torch.ones_like(ids), labels=_tokens(rank, step, (4,), 3)).loss


def _seq2seq(model, rank, step):
    return model(input_ids=_tokens(rank, step), labels=_tokens(rank, 50 + step, (4, 7))).loss


def _encoder(model, rank, step):
    x, y = _sequences(rank, step)
    return mse_loss(model(x), y[:, 0, :3])


def _attention(model, rank, step):  # self-attention (query is key is value): MHA's own fast path in eval
    x, y = _sequences(rank, step)
    return mse_loss(model(x, x, x, need_weights=False)[0], y)


def _regression(model, rank, step):
    x, y = batch(rank, step)
    return mse_loss(model(x), y)


# name -> (builder, loss of (model, rank, step)); each built after torch.manual_seed(0)
ZOO = {
    "transformers": {
        "gpt2 (tied head)": (tiny_gpt2, _clm),
        "llama": (tiny_llama, _clm),
        "bert": (tiny_bert, _classify),
        "t5": (tiny_t5, _seq2seq),
    },
    "torch.nn": {
        "TransformerEncoder": (EncoderNet, _encoder),
        "MultiheadAttention root": (lambda: nn.MultiheadAttention(WIDTH, 2, batch_first=True), _attention),
        "pruned Linear": (pruned, _regression),
        "weight_norm parametrization": (weight_norm_parametrized, _regression),
        "weight_norm pre-hook": (weight_norm_hooked, _regression),
    },
}
FAST_PATHS = ("_transformer_encoder_layer_fwd", "_native_multi_head_attention")


@contextlib.contextmanager
def counting_fast_paths(counts: dict[str, int]):
    """Count the calls of the eval fast paths' fused ops (looked up on ``torch`` at each call)."""
    originals = {name: getattr(torch, name) for name in FAST_PATHS}

    def counted(name):
        def call(*args, **kwargs):
            counts[name] = counts.get(name, 0) + 1
            return originals[name](*args, **kwargs)

        return call

    try:
        for name in FAST_PATHS:
            setattr(torch, name, counted(name))
        yield counts
    finally:
        for name, op in originals.items():
            setattr(torch, name, op)


def _train(build, loss_of, rank: int, overlap: bool) -> dict:
    """STEPS steps, an evaluation forward right after each (no wait before it); then the params."""
    torch.manual_seed(0)
    model = build()
    checks = {"check_param_reads": True} if "check_param_reads" in ZeroConfig.__dataclass_fields__ else {}
    inner = torch.optim.AdamW(model.parameters(), lr=1e-2)
    opt = LowLevelZeroOptimizer(model, inner, stage=2, reduce_bucket_mb=BUCKET_MB, overlap_allgather=overlap, **checks)
    run = {"losses": [], "evals": [], "fast": {}, "error": None}
    try:
        for step in range(STEPS):
            loss = loss_of(model, rank, step)
            run["losses"].append(loss.item())
            opt.backward(loss)
            assert opt.step(), f"step {step} skipped"
            opt.zero_grad()
            model.eval()
            with torch.no_grad(), counting_fast_paths(run["fast"]):
                run["evals"].append(loss_of(model, rank, 100 + step).item())
            model.train()
    except RuntimeError as e:
        run["error"] = f"step {step}: {type(e).__name__}: {e}"
        return run
    run["state"] = {k: v.clone() for k, v in model.state_dict().items()}  # the gate of model.state_dict()
    return run


def _differences(name: str, off: dict, on: dict) -> list[str]:
    """What overlap on did differently from overlap off (nothing, when every read is current)."""
    if off["error"]:
        return [f"{name}: the reference (overlap off) failed: {off['error']}"]
    if on["error"]:
        return [f"{name}: {on['error'][:400]}"]
    found = []
    for key in ("losses", "evals"):
        if on[key] != off[key]:
            first = next(i for i, (a, b) in enumerate(zip(on[key], off[key])) if a != b)
            found.append(f"{name}: {key} differ from step {first}: on {on[key]} vs off {off[key]}")
    unequal = [k for k in off["state"] if not torch.equal(on["state"][k], off["state"][k])]
    if unequal:
        found.append(f"{name}: final params differ: {unequal[:4]}{'...' if len(unequal) > 4 else ''}")
    return found


def _zoo_body(rank: int, world_size: int, group: str) -> None:
    found = []
    for name, (build, loss_of) in ZOO[group].items():
        off, on = (_train(build, loss_of, rank, overlap) for overlap in (False, True))
        found += _differences(name, off, on)
        if name == "TransformerEncoder":  # the reference evaluates on the layer's fused fast path
            assert off["fast"].get("_transformer_encoder_layer_fwd") == 2 * STEPS, off["fast"]
        if name == "MultiheadAttention root":  # on MHA's own, with and without overlap
            assert off["fast"].get("_native_multi_head_attention") == STEPS, off["fast"]
            assert on["error"] or on["fast"].get("_native_multi_head_attention") == STEPS, on["fast"]
    assert not found, f"rank {rank}:\n" + "\n".join(found)


@pytest.mark.parametrize("group", list(ZOO))
def test_overlap_gives_the_bits_of_overlap_off_for_every_read_of_the_zoo(group):
    """Losses, evaluation losses and final params equal, bit for bit, and no stale-read error."""
    run_distributed(_zoo_body, 2, group=group)
