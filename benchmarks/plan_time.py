"""The plan's predicted step time against measured ``LowZeroTrainer`` steps, on this machine.

    python benchmarks/plan_time.py [--rounds 3] [--steps 6]   # results/plan_time.{md,json,png}

For three small models (GPT-2, Llama and BERT shapes), at W = 1 and 2 gloo ranks (one thread each,
as ``run_distributed`` starts them) and stages 0, 1 and 2 plus stage 2 with offload:

- predicted: the plan's simulated step on fake CPU tensors, timed for ``--device cpu`` with one
  host thread (``hf_lowzero.timing``; this machine calibrated once, cached);
- measured: ``LowZeroTrainer`` on the same arguments, ``steps`` steps per run after two of warm-up,
  each step timed from ``on_step_begin`` to ``on_step_end``; the cases interleaved, ``rounds``
  rounds; the median.

The ratio predicted / measured is the plan's error. The machine is shared: say how loaded it was.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from benchmarks.common import RESULTS, collect, write_results  # noqa: E402

BATCH, SEQ, VOCAB = 4, 64, 1000
SETUPS = [(0, False), (1, False), (2, False), (2, True)]


def configs() -> dict:
    from transformers import BertConfig, GPT2Config, LlamaConfig

    return {
        "gpt2": GPT2Config(n_layer=4, n_embd=128, n_head=4, vocab_size=VOCAB, n_positions=SEQ, resid_pdrop=0.0,
                           embd_pdrop=0.0, attn_pdrop=0.0),
        "llama": LlamaConfig(num_hidden_layers=4, hidden_size=128, intermediate_size=344, num_attention_heads=4,
                             num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=SEQ),
        "bert": BertConfig(num_hidden_layers=4, hidden_size=128, intermediate_size=512, num_attention_heads=4,
                           vocab_size=VOCAB, max_position_embeddings=SEQ, hidden_dropout_prob=0.0,
                           attention_probs_dropout_prob=0.0),
    }  # fmt: skip


def arguments(out: str, stage: int, offload: bool, steps: int):
    from hf_lowzero import LowZeroTrainingArguments

    return LowZeroTrainingArguments(
        output_dir=out, use_cpu=True, report_to=[], per_device_train_batch_size=BATCH, max_steps=steps,
        learning_rate=1e-3, logging_steps=10**6, save_strategy="no", zero_stage=stage,
        zero_offload_optimizer=offload, dataloader_num_workers=0, disable_tqdm=True,
    )  # fmt: skip


class Data(torch.utils.data.Dataset):
    def __init__(self, task: str) -> None:
        g = torch.Generator().manual_seed(0)
        self.ids = torch.randint(0, VOCAB, (256, SEQ), generator=g)
        self.task = task

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i):
        ids = self.ids[i]
        return {"input_ids": ids, "labels": ids if self.task == "clm" else torch.tensor(i % 2)}


def build(name: str):
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    torch.manual_seed(0)
    config = configs()[name]
    if name == "bert":
        return AutoModelForSequenceClassification.from_config(config), "cls"
    return AutoModelForCausalLM.from_config(config), "clm"


def body(rank: int, world_size: int, out: str, rounds: int, steps: int) -> None:
    from transformers import TrainerCallback

    from hf_lowzero import LowZeroTrainer

    class Clock(TrainerCallback):
        def __init__(self) -> None:
            self.times: list[float] = []

        def on_step_begin(self, args, state, control, **kwargs):
            self.start = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            self.times.append(time.perf_counter() - self.start)

    measured: dict[str, list[float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for _ in range(rounds):
            for name in configs():
                for stage, offload in SETUPS:
                    model, task = build(name)
                    clock = Clock()
                    trainer = LowZeroTrainer(model=model, args=arguments(tmp, stage, offload, steps + 2),
                                             train_dataset=Data(task), callbacks=[clock])  # fmt: skip
                    trainer.train()
                    key = f"{name} stage {stage}{' + offload' if offload else ''}"
                    measured.setdefault(key, []).extend(clock.times[2:])
    if rank == 0:
        Path(out).write_text(json.dumps({k: statistics.median(v) for k, v in measured.items()}))


def predicted(world_size: int) -> dict[str, float]:
    from hf_lowzero.plan.models import ModelSpec
    from hf_lowzero.plan.simulate import simulate_step
    from hf_lowzero.plan.step_records import Setup, TrainingSpec
    from hf_lowzero.timing import Costs, Target, schedule

    costs = Costs(Target.of("cpu", host_threads=1))
    times = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, config in configs().items():
            config.architectures = ["BertForSequenceClassification" if name == "bert" else None]
            spec = ModelSpec.from_source(build(name)[0])
            for stage, offload in SETUPS:
                training = TrainingSpec.from_args(arguments(tmp, stage, offload, 1))
                step = simulate_step(spec, training, Setup(stage, offload), world_size, BATCH, SEQ, backend="gloo")
                key = f"{name} stage {stage}{' + offload' if offload else ''}"
                times[key] = schedule(step.program, costs).step_time().seconds
    return times


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--world-sizes", default="1,2")
    a = parser.parse_args()
    rows = []
    load = os.getloadavg()[0]
    for world_size in map(int, a.world_sizes.split(",")):
        planned = predicted(world_size)
        measured = collect(body, world_size, rounds=a.rounds, steps=a.steps)
        for key, seconds in measured.items():
            ms = {"predicted_ms": round(planned[key] * 1e3, 2), "measured_ms": round(seconds * 1e3, 2)}
            rows.append({"case": key, "W": world_size, **ms, "ratio": round(planned[key] / seconds, 3)})
    header = (
        "# Predicted against measured step time on this machine\n\n"
        f"`python benchmarks/plan_time.py --rounds {a.rounds} --steps {a.steps}`: the plan's step for `--device cpu`, "
        f"one host thread, against the median LowZeroTrainer step (batch {BATCH} x {SEQ}, fp32, "
        f"{os.cpu_count()} cores, load average {load:.1f} at the start). ratio = predicted / measured."
    )
    print(write_results("plan_time", rows, ["case", "W", "predicted_ms", "measured_ms", "ratio"], header))
    plot(rows, RESULTS / "plan_time.png")


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 6))
    for w, marker in ((1, "o"), (2, "s")):
        pts = [(r["measured_ms"], r["predicted_ms"]) for r in rows if r["W"] == w]
        if pts:
            ax.scatter(*zip(*pts), marker=marker, label=f"W={w}")
    low = min(min(r["measured_ms"], r["predicted_ms"]) for r in rows) / 1.5
    top = max(max(r["measured_ms"], r["predicted_ms"]) for r in rows) * 1.5
    ax.plot([low, top], [low, top], color="black", linewidth=1, label="predicted = measured")
    ax.fill_between([low, top], [0.8 * low, 0.8 * top], [1.2 * low, 1.2 * top], color="gray", alpha=0.15,
                    label="within 20%")  # fmt: skip
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("measured ms per step (LowZeroTrainer)")
    ax.set_ylabel("predicted ms per step (the plan, --device cpu)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
