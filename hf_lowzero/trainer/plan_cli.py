"""``python -m hf_lowzero.trainer.plan_cli``: print a memory plan for a model and Trainer arguments.

It parses the Trainer's flags, so it sits in ``trainer/``, above the plan it calls (``hf_lowzero.plan``
imports nothing of the Trainer).

Example::

    python -m hf_lowzero.trainer.plan_cli --model path/to/model_or_config.json --world-size 8 --device-memory 80GiB \
        --seq-len 2048 --bf16 --per_device_train_batch_size 4 --optim adamw_torch_fused [--lora-r 16]

Flags after the plan's own are ``TrainingArguments`` flags (``LowZeroTrainingArguments``: the
``--zero_*`` knobs too), exactly as the training script takes them. Without ``--device-memory`` it
plans for this machine's GPU, or without one prints every setup's peak and the smallest common
device it fits (``devices.py``). ``--world-size 8,16,32`` plans each size and adds a scaling table
(``plan/scaling.py``); ``--price-per-device-hour 2.5 [--tokens 1e9]`` a cost column (``plan/cost.py``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m hf_lowzero.trainer.plan_cli",
        description="Which ZeRO setup fits, with what batch: simulated for your model and Trainer arguments.",
        epilog="Other flags are TrainingArguments flags (--bf16, --optim, --per_device_train_batch_size, "
        "--gradient_checkpointing, --gradient_accumulation_steps, --zero_config, ...).",
    )
    parser.add_argument(
        "--model",
        required=True,
        help="a model directory, a config.json, or a Hugging Face Hub id (its config only: from the local cache, "
        "or from the Hub when online)",
    )
    parser.add_argument(
        "--world-size",
        default="1",
        help="data-parallel ranks (GPUs) in all; several, such as 8,16,32: the largest one's plan, then a scaling "
        "table (each size's recommended setup, its step time, tokens/s and efficiency against linear scaling)",
    )
    parser.add_argument(
        "--device-memory",
        default=None,
        help="memory per device, e.g. 80GiB or 40GB (default: this machine's GPU; without one, every setup's peak "
        "and the smallest of 16, 24, 40, 48, 80 and 141 GiB it fits)",
    )
    parser.add_argument("--host-memory", default=None, help="host memory available per node, to check offload against")
    parser.add_argument(
        "--ranks-per-node", type=int, default=None, help="ranks sharing a node's host memory (default: min(world, 8))"
    )
    parser.add_argument("--seq-len", type=int, default=None, help="tokens per sample (default: the model's, <= 2048)")
    parser.add_argument("--lora-r", type=int, default=None, help="plan a LoRA adapter of this rank")
    parser.add_argument("--lora-targets", default=None, help="comma-separated module names for LoRA (peft's default)")
    parser.add_argument("--ref-model", action="store_true", help="a frozen reference model too (DPO, GRPO)")
    parser.add_argument("--reserve", type=float, default=0.10, help="fraction of device memory kept free (0.10)")
    parser.add_argument(
        "--backend",
        choices=["nccl", "gloo"],
        default=None,
        help="nccl: plan GPUs (simulated on fake CUDA devices; default); gloo: plan CPU ranks (default with "
        "--device cpu)",
    )
    timing = parser.add_argument_group("time (docs/plan.md: the model behind the time columns)")
    timing.add_argument(
        "--device",
        default=None,
        help="the device the time columns are for, and its memory when --device-memory is not given: H100, H200, "
        "A100-80GB, A100-40GB, A10G, L4, L40S, RTX4090, or cpu (this machine, measured once); default: this "
        "machine's GPU if the table has it, else H100 (cpu with --backend gloo)",
    )
    timing.add_argument("--gpus-per-node", type=int, default=None, help="devices per node (default 8; cpu: all)")
    timing.add_argument(
        "--intra-node", default=None, help="bandwidth between a node's devices, e.g. 450GB/s (default: the device's)"
    )
    timing.add_argument(
        "--inter-node", default=None, help="a node's network, e.g. 100Gb/s or 3200Gb/s (default: the device's)"
    )
    timing.add_argument("--host-threads", type=int, default=None, help="host threads per rank (default 4; cpu: all)")
    timing.add_argument(
        "--price-per-device-hour",
        default=None,
        help="what one device costs per hour, in your currency: adds the cost of training --tokens tokens with "
        "each setup (and at each world size)",
    )
    timing.add_argument(
        "--tokens",
        default=None,
        help="the tokens --price-per-device-hour prices, e.g. 1e9, 500M or 2B (default 1e9)",
    )
    parser.add_argument(
        "--json",
        nargs="?",
        const="-",
        default=None,
        help="print the plan as JSON instead of the table; --json FILE: also write it to FILE",
    )
    own, rest = parser.parse_known_args(argv)

    from hf_lowzero.plan.cost import DEFAULT_TOKENS, Price
    from hf_lowzero.plan.scaling import parse_world_sizes, plan_scaling

    try:  # checked before anything runs
        world_sizes = parse_world_sizes(own.world_size)
        price = None
        if own.price_per_device_hour is not None:
            price = Price.of(own.price_per_device_hour, own.tokens if own.tokens is not None else DEFAULT_TOKENS)
        elif own.tokens is not None:
            raise ValueError(
                f"--tokens {own.tokens} names the tokens --price-per-device-hour prices; give the price too "
                "(e.g. --price-per-device-hour 2.5), or drop --tokens"
            )
    except ValueError as e:
        parser.exit(2, f"{parser.prog}: error: {e}\n")

    from transformers import HfArgumentParser

    from hf_lowzero.plan.devices import plan_devices, this_gpu
    from hf_lowzero.plan.planner import format_bytes, plan_memory
    from hf_lowzero.timing.devices import find_device
    from hf_lowzero.trainer.arguments import LowZeroTrainingArguments

    if not any(a.startswith("--output_dir") for a in rest):
        rest += ["--output_dir", os.devnull]
    if not torch.cuda.is_available() and "--use_cpu" not in rest:
        rest += ["--use_cpu"]  # planning a GPU cluster from a laptop: let the precision flags validate here
    rest += ["--report_to", "none"]
    try:
        (args,) = HfArgumentParser(LowZeroTrainingArguments).parse_args_into_dataclasses(rest)
    except SystemExit:
        return 2
    targets = own.lora_targets.split(",") if own.lora_targets else None
    options = dict(
        world_size=world_sizes[0],
        seq_len=own.seq_len,
        host_memory=own.host_memory,
        ranks_per_node=own.ranks_per_node,
        lora_r=own.lora_r,
        lora_targets=targets,
        ref_model=own.ref_model,
        reserve=own.reserve,
        backend=own.backend or ("gloo" if (own.device or "").lower() == "cpu" else "nccl"),
    )
    if own.device is not None:
        names = ("gpus_per_node", "intra_node", "inter_node", "host_threads")
        options["target"] = {"device": own.device} | {n: getattr(own, n) for n in names if getattr(own, n) is not None}
    elif any(getattr(own, n) is not None for n in ("gpus_per_node", "intra_node", "inter_node", "host_threads")):
        parser.exit(
            2,
            f"{parser.prog}: error: --gpus-per-node, --intra-node, --inter-node and --host-threads "
            "describe the --device they go with; name it (e.g. --device H100)\n",
        )
    device_memory = own.device_memory
    if device_memory is None and own.device is not None:
        try:
            device_memory = find_device(own.device).memory_bytes or None  # cpu: no memory figure
        except ValueError as e:
            parser.exit(2, f"{parser.prog}: error: {e}\n")
    gpu = this_gpu() if device_memory is None and own.device is None else None
    if gpu is not None:
        name, device_memory = gpu
        print(
            f"Planning for this machine's GPU 0, {name} ({format_bytes(device_memory)}); --device-memory SIZE "
            "plans another size\n"
        )
    if len(world_sizes) > 1 and device_memory is None:
        parser.exit(
            2,
            f"{parser.prog}: error: --world-size {own.world_size} compares the recommended setup at each size, which "
            "needs a device size: give --device-memory (e.g. 80GiB) or --device (e.g. H100)\n",
        )
    try:
        if len(world_sizes) > 1:
            del options["world_size"]
            plan = plan_scaling(own.model, args, world_sizes=world_sizes, price=price, device_memory=device_memory,
                                **options)  # fmt: skip
        elif device_memory is None:
            plan = plan_devices(own.model, args, **options)
        else:
            plan = plan_memory(own.model, args, device_memory=device_memory, **options)
    except (ValueError, TypeError, OSError) as e:  # OSError: e.g. a config.json that is not JSON
        parser.exit(2, f"{parser.prog}: error: {e}\n")  # one line and exit status 2, as argparse's errors
    if price is not None and len(world_sizes) == 1:
        price.apply(plan.plan if device_memory is None else plan)
    text = json.dumps(plan.to_dict(), indent=2)  # the table and the JSON: one record, the plan's rows
    print(text if own.json == "-" else plan.to_text())
    if own.json not in (None, "-"):
        from pathlib import Path

        from hf_lowzero.checkpoint.atomic import atomic_write

        atomic_write(Path(own.json), lambda tmp: Path(tmp).write_text(text))
    if len(world_sizes) > 1:
        fits = plan.fits_everywhere
    else:
        fits = plan.fits_any if device_memory is None else plan.recommended is not None
    return 0 if fits else 1


if __name__ == "__main__":
    sys.exit(main())
