"""Train a small model with ZeRO and check it against DDP, on CPU or GPU.

    torchrun --nproc-per-node 2 examples/train_zero.py --stage 2 --steps 20

Each rank trains on its own data; the script trains the same model with
``LowLevelZeroOptimizer`` and with ``DistributedDataParallel`` side by side, prints the loss, the
largest parameter difference between the two, and this rank's memory report.
"""

from __future__ import annotations

import argparse
import copy
import os

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from hf_lowzero import LowLevelZeroOptimizer, ZeroConfig


def build_model(vocab: int = 211, width: int = 96) -> nn.Module:
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(width, nhead=4, dim_feedforward=4 * width, batch_first=True, dropout=0.0)
    return nn.Sequential(
        nn.Embedding(vocab, width), nn.TransformerEncoder(layer, num_layers=2), nn.Linear(width, vocab)
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--stage", type=int, default=2)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--clip", type=float, default=1.0)
    args = parser.parse_args()

    use_cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if use_cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)

    model = build_model().to(device)
    ddp = DDP(copy.deepcopy(model))
    config = ZeroConfig(stage=args.stage, clip_grad_norm=args.clip)
    opt = LowLevelZeroOptimizer(model, torch.optim.AdamW(model.parameters(), lr=args.lr), config)
    ddp_opt = torch.optim.AdamW(ddp.parameters(), lr=args.lr)

    gen = torch.Generator().manual_seed(rank)
    for step in range(args.steps):
        tokens = torch.randint(0, 211, (8, 33), generator=gen).to(device)
        inputs, targets = tokens[:, :-1], tokens[:, 1:]
        loss = nn.functional.cross_entropy(model(inputs).flatten(0, 1), targets.flatten())
        opt.backward(loss)
        opt.step()
        opt.zero_grad()

        ddp_loss = nn.functional.cross_entropy(ddp(inputs).flatten(0, 1), targets.flatten())
        ddp_loss.backward()
        nn.utils.clip_grad_norm_(ddp.parameters(), args.clip)
        ddp_opt.step()
        ddp_opt.zero_grad()

        diff = max((p - q).abs().max().item() for p, q in zip(model.parameters(), ddp.module.parameters()))
        if rank == 0:
            print(
                f"step {step:3d}  loss {loss.item():.4f}  ddp loss {ddp_loss.item():.4f}  "
                f"grad norm {opt.last_grad_norm:.4f}  max |zero - ddp| {diff:.2e}"
            )
    for r in range(world):
        if r == rank:
            print(f"rank {rank} memory (MiB): {opt.memory_report().as_mib()}", flush=True)
        dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
