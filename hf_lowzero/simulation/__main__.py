"""``python -m hf_lowzero.simulation``: the GPU step on fake CUDA tensors, every default case.

    python -m hf_lowzero.simulation                  # W=2 and 4: stages, offload, precisions, ...
    python -m hf_lowzero.simulation --world-sizes 2  # the fast half

Prints one line per case (collectives issued per rank, tensor accesses ordered, pinned bytes) and
exits 1 at the first rule broken, race found or sequence that differs across ranks, naming it.
"""

from __future__ import annotations

import argparse
import sys

from hf_lowzero.simulation.gpu_step import check_cases, default_cases
from hf_lowzero.simulation.launch import call_on_fake_gpus
from hf_lowzero.simulation.nccl import NcclRuleError
from hf_lowzero.simulation.streams import RaceError


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hf_lowzero.simulation", description=__doc__.split("\n")[0])
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4], help="world sizes to simulate")
    own = parser.parse_args(argv)
    if any(w < 1 for w in own.world_sizes):
        parser.error(f"--world-sizes {own.world_sizes}: each must be >= 1")
    cases = [c for c in default_cases() if c.world_size in own.world_sizes]
    try:
        results = call_on_fake_gpus(check_cases, cases)
    except (RaceError, NcclRuleError) as e:
        print(f"FAILED: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    for r in results:
        pinned = max(run.optimizer_pinned for run in r.runs)
        print(
            f"ok  {r.case.label:<62} {r.collectives:3d} collectives per rank, {r.accesses:6d} accesses ordered, "
            f"{pinned:7d} B pinned per rank"
        )
    print(f"{len(results)} cases: every rank issued the same collectives under NCCL's rules, and no race was found")
    return 0


if __name__ == "__main__":
    sys.exit(main())
