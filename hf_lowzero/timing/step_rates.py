"""The rates a CPU reaches inside a training step, measured op by op in a small reference model's step.

[Note: rates in a step] A kernel timed alone, over and over, runs on operands that stay in cache and
on memory the allocator hands straight back. In a step it does not: each op reads what an earlier
op wrote a while ago, and writes into memory the step has not touched yet. Measured op by op in a
small GPT-2, BERT and Llama step on this machine (2 cores, one thread, ``torch.profiler``'s self
time), the matmuls ran 10-15% below their rate alone, a GELU's forward and backward at half of it,
and ``tanh`` (GPT-2's ``gelu_new``) at a sixth of the bandwidth of the other per-element ops. A
model priced at the rates alone came out 0.76-0.83 of those steps.

So ``cpu`` also runs a reference step: a small transformer of ``torch.nn`` parts (not one of the
models it plans), three blocks whose MLPs use an exact GELU, a tanh GELU and a SiLU gate, and
whose attention (``scaled_dot_product_attention``) has heads of 32, 64 and 128, then a
cross-entropy head. It runs twice, on the same 256 tokens: 4 sequences of 64 and one of 256
(``SHAPES``). Its forward and backward run under a dispatch mode that times every op in CPU
seconds; the figures are what those ops reached:

- ``matmul_flops``: the matmuls' FLOPs per second in the step (``calibrate.py`` keeps it over the
  rate of the 512 x 512 ``mm`` alone, and the costs scale both dtypes' rates by it);
- ``attention``: the flash attention's FLOPs per second, forward and backward, over all, and
  ``attention_by_head`` for each head size (32, 64 and 128) and keys per sequence (64 and 256). A
  CPU's flash attention pays for each row of queries as well as for each score: alone, a head of
  32 ran at 46 GFLOP/s over 64 keys, 55 over 128 and 65 over 256 and 512, and a head of 128 at
  about 1.3 times those (the costs take 1 / rate = a + b / keys through the two lengths measured);
- ``math``: each per-element op's bytes per second (``counting.PER_ELEMENT_MATH``), and
  ``bandwidth_math`` for all of them together (what a per-element op the step did not run is
  priced at).

Example::

    found = step_rates(threads=1)
    found["matmul_flops"], found["math"]["aten.tanh"]
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from hf_lowzero.timing.counting import CPU_ATTENTION, PER_ELEMENT_MATH, is_query, op_work, with_cpu_attention

WIDTH, VOCAB = 256, 2000
SHAPES = ((4, 64), (1, 256))  # (sequences, tokens each): the attention over short keys and long, the same matmuls
# Each block's MLP activation and head size: an encoder's GELU, GPT-2's tanh GELU, Llama's SiLU gate.
BLOCKS = (("gelu", 32), ("tanh", 64), ("silu", 128))
WARM_UP, TIMED = 2, 5


class _Block(nn.Module):
    def __init__(self, activation: str, head_size: int) -> None:
        super().__init__()
        self.activation, self.heads = activation, WIDTH // head_size
        self.norm1, self.norm2 = nn.LayerNorm(WIDTH), nn.LayerNorm(WIDTH)
        self.qkv, self.proj = nn.Linear(WIDTH, 3 * WIDTH), nn.Linear(WIDTH, WIDTH)
        self.up, self.down = nn.Linear(WIDTH, 4 * WIDTH), nn.Linear(4 * WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=self.activation != "gelu")  # a decoder's
        x = x + self.proj(attended.transpose(1, 2).reshape(b, t, d))
        h = self.up(self.norm2(x))
        if self.activation == "gelu":
            h = F.gelu(h)
        elif self.activation == "tanh":  # GPT-2's gelu_new, as transformers writes it
            h = 0.5 * h * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (h + 0.044715 * torch.pow(h, 3.0))))
        else:
            h = F.silu(h) * h
        return x + self.down(h)


class _Reference(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.blocks = nn.Sequential(*(_Block(a, head) for a, head in BLOCKS))
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        logits = self.head(self.blocks(self.embed(ids)))
        return F.cross_entropy(logits.flatten(0, 1), ids.flatten())


class OpClock(TorchDispatchMode):
    """Per op name (an attention's with ``@`` its head size and ``@`` its keys per sequence): CPU
    seconds per thread, FLOPs and bytes (``counting.py``'s)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: dict[str, list[float]] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        start = time.process_time()
        out = func(*args, **kwargs)
        seconds = (time.process_time() - start) / torch.get_num_threads()
        if not is_query(func):
            work = op_work(func, args, kwargs, out)
            name = work.name
            if name in CPU_ATTENTION:
                work = with_cpu_attention(args, work)
                name = f"{name}@{work.head_size}@{work.tokens}"
            found = self.ops.setdefault(name, [0.0, 0.0, 0.0])
            found[0] += seconds
            found[1] += work.flops
            found[2] += work.nbytes
        return out


def reference_step(sequences: int = SHAPES[0][0], tokens: int = SHAPES[0][1]) -> Callable[[], None]:
    """One forward and backward of the reference model ([Note: rates in a step]) on ``sequences`` of
    ``tokens``, built once."""
    torch.manual_seed(0)
    model = _Reference()
    ids = torch.randint(0, VOCAB, (sequences, tokens))
    return lambda: model(ids).backward()


def step_rates(threads: int) -> dict:
    """What the reference step's ops reached at ``threads`` threads ([Note: rates in a step]): each
    figure the median of ``TIMED`` steps' (one a step of each shape), as a VM's pace wanders."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        steps = [reference_step(*shape) for shape in SHAPES]
        for step in steps:
            for _ in range(WARM_UP):
                step()
        found = []
        for _ in range(TIMED):
            with OpClock() as clock:
                for step in steps:
                    step()
            found.append(_figures(clock.ops))
    finally:
        torch.set_num_threads(before)
    return _median(found)


def _figures(ops: dict[str, list[float]]) -> dict:
    """The figures of one clock's ops (``OpClock.ops``)."""
    attention: dict[tuple[int, int], list] = {}  # (head size, keys): forward's and backward's
    for name, v in ops.items():
        op, _, shape = name.partition("@")
        if op in CPU_ATTENTION:
            head, _, keys = shape.partition("@")
            attention.setdefault((int(head), int(keys)), []).append(v)
    by_head: dict[str, dict[str, float]] = {}
    for (head, keys), found in sorted(attention.items()):
        by_head.setdefault(str(head), {})[str(keys)] = _ratio(found, 1)
    matmuls = [v for name, v in ops.items() if v[1] > 0 and name.partition("@")[0] not in CPU_ATTENTION]
    per_element = {name: v for name, v in ops.items() if name in PER_ELEMENT_MATH}
    return {
        "matmul_flops": _ratio(matmuls, 1),
        "attention": _ratio([v for found in attention.values() for v in found], 1),
        "attention_by_head": by_head,
        "math": {name: _ratio([v], 2) for name, v in sorted(per_element.items())},
        "bandwidth_math": _ratio(list(per_element.values()), 2),
    }


def _median(found: list[dict]):
    """Figure by figure, at any depth of dicts, the median of ``found``'s."""
    if isinstance(found[0], dict):
        return {key: _median([f[key] for f in found]) for key in found[0]}
    return statistics.median(found)


def _ratio(found: list[list[float]], index: int) -> float:
    """FLOPs (``index`` 1) or bytes (2) per second over ``found``."""
    return sum(v[index] for v in found) / max(sum(v[0] for v in found), 1e-9)
