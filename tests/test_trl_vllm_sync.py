"""TRL's weight sync to vLLM sees the updated params under ``overlap_allgather``
([Note: params are current]; ``hf_lowzero/trainer/weight_sync.py``).

GRPO with ``use_vllm`` in server mode, trained for real at W=2, stage 2: the vLLM server is the external
boundary, so ``trl.generation.vllm_generation.VLLMClient`` is replaced by a recorder that keeps every
weight it is sent and answers ``generate`` with fixed completions. Everything between (GRPO's
generation step, ``VLLMGeneration.sync_weights`` and its ``named_parameters()`` walk) is TRL's own.
The weights each sync sends with the overlapped all-gather must be those sent without it.
"""

import types

import pytest
import torch

trl = pytest.importorskip("trl")

from trl import GRPOConfig, GRPOTrainer  # noqa: E402
from trl.generation import vllm_generation  # noqa: E402

from hf_lowzero import with_zero  # noqa: E402
from hf_lowzero.testing import run_distributed  # noqa: E402
from hf_lowzero.trainer.weight_sync import WEIGHT_SYNCS, gate_weight_syncs  # noqa: E402
from tests.trl_setup import char_tokenizer, prompt_dataset, tiny_causal_lm, vowel_reward  # noqa: E402

STEPS = 3
COMPLETIONS = ["ae", "xz", "ab", "tea", "zero"]  # what the "server" generates, in turn


class RecordingVLLMClient:
    """The vLLM server's client, as ``VLLMGeneration`` calls it in server mode: records each weight sync
    ({name: tensor}, copied as received) and generates fixed completions, with other rewards in each group."""

    syncs: list[dict[str, torch.Tensor]] = []

    def __init__(self, base_url, group_port, connection_timeout) -> None:
        self.tokenizer = char_tokenizer()

    def init_communicator(self, device) -> None:
        pass

    def update_named_params(self, metadata, named_tensors) -> None:
        sent = {name: tensor.detach().clone() for name, tensor in named_tensors}
        assert [name for name, _, _ in metadata] == list(sent)
        RecordingVLLMClient.syncs.append(sent)

    def reset_prefix_cache(self) -> None:
        pass

    def generate(self, prompts, features=None, n=1, max_tokens=16, **sampling) -> dict:
        texts = [COMPLETIONS[i % len(COMPLETIONS)] for i in range(len(prompts) * n)]
        eos = self.tokenizer.eos_token_id
        completions = [self.tokenizer.convert_tokens_to_ids(list(text)) + [eos] for text in texts]
        return {
            "prompt_ids": prompts,
            "completion_ids": [c[:max_tokens] for c in completions],
            "logprobs": [[[-1.0] for _ in c[:max_tokens]] for c in completions],
        }


def synced_weights(tmp: str, overlap: bool) -> list[dict[str, torch.Tensor]]:
    """What the server received at each of GRPO's syncs, training with ``overlap_allgather`` on or off."""
    RecordingVLLMClient.syncs = []
    tok = char_tokenizer()
    args = with_zero(GRPOConfig)(
        output_dir=f"{tmp}/overlap{overlap}",
        use_cpu=True,
        bf16=False,
        max_steps=STEPS,
        per_device_train_batch_size=4,
        num_generations=2,
        max_completion_length=8,
        learning_rate=3e-2,
        use_vllm=True,
        vllm_mode="server",
        vllm_importance_sampling_correction=False,
        save_strategy="no",
        report_to=[],
        disable_tqdm=True,
        seed=0,
        zero_stage=2,
        zero_reduce_bucket_mb=0.01,  # several buckets, each gathered after the step
        zero_overlap_allgather=overlap,
    )
    trainer = with_zero(GRPOTrainer)(
        model=tiny_causal_lm(tok),
        reward_funcs=vowel_reward,
        args=args,
        train_dataset=prompt_dataset(),
        processing_class=tok,
    )
    trainer.train()
    return RecordingVLLMClient.syncs


def vllm_sync_body(rank, world_size, tmp):
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(vllm_generation, "is_vllm_available", lambda: True)
        patch.setattr(vllm_generation, "VLLMClient", RecordingVLLMClient)
        ours, reference = synced_weights(tmp, overlap=True), synced_weights(tmp, overlap=False)
    if rank != 0:  # only the main process talks to the server
        assert ours == reference == []
        return
    assert len(ours) == len(reference) == STEPS
    for step in range(1, STEPS):  # after each step the weights changed
        assert any(not torch.equal(reference[step][n], reference[step - 1][n]) for n in reference[step])
    for step, (sent, expected) in enumerate(zip(ours, reference)):
        assert list(sent) == list(expected)
        for name in expected:
            assert torch.equal(sent[name], expected[name]), f"sync {step}: {name} is not the weight after step {step}"


def test_grpo_syncs_the_updated_weights_to_vllm_with_overlapped_allgather(tmp_path):
    run_distributed(vllm_sync_body, 2, tmp=str(tmp_path))


def test_each_known_sync_waits_for_params_first():
    calls = []

    class Engine:  # VLLMGeneration's part
        def sync_weights(self):
            calls.append("sync_weights")

    class OnlineTrainer:  # a trainer that pushes by itself and keeps an engine
        def __init__(self):
            self.vllm_generation = Engine()

        def _move_model_to_vllm(self):
            calls.append("_move_model_to_vllm")

    trainer = OnlineTrainer()
    gate_weight_syncs(trainer, lambda: calls.append("wait"))
    trainer.vllm_generation.sync_weights()
    trainer._move_model_to_vllm()
    assert calls == ["wait", "sync_weights", "wait", "_move_model_to_vllm"]
    assert [name for _, name in WEIGHT_SYNCS] == ["sync_weights", "_move_model_to_vllm"]
    offline = types.SimpleNamespace(vllm_generation=None)  # GRPO without use_vllm: nothing to gate
    gate_weight_syncs(offline, lambda: calls.append("wait"))
    assert offline == types.SimpleNamespace(vllm_generation=None)
