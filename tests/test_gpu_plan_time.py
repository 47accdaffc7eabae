"""benchmarks/gpu_plan_time.py, the GPU check's step that compares the plan's step time with the GPU
benchmarks' (issue 56): the parts that run without a GPU. The prediction for the benchmarks' setups
under ``--device H100`` (on fake GPUs, tiny shapes here), and the comparison against measured JSON
in the shapes ``gpu_single.py`` and ``gpu_overlap.py`` write.
"""

from __future__ import annotations

import json

import pytest

from benchmarks import gpu_plan_time
from benchmarks.overlap_report import W1

SINGLE = {"shape": (2, 64, 4), "batch": 2, "seq": 32}
OVERLAP = {"shape": (2, 64, 4), "batch": 2, "seq": 32, "links": (100.0, 0.01)}


def write_measured(folder, single_ms: float, w1_ms: float, links_ms: dict[float, float]) -> None:
    trainer = [{"setup": name, "ms_per_step": single_ms} for name in gpu_plan_time.SINGLE_SETUPS]
    (folder / "gpu_single.json").write_text(json.dumps({"trainer": trainer, "optimizer": []}))
    variants = [{"setup": W1, "mode": "none", "link_GB_s": "", "ms": w1_ms}]
    summary = [{"setup": "W=2, overlap on", "link_GB_s": link, "all_ms": ms} for link, ms in links_ms.items()]
    summary.append({"setup": "W=2, overlap off", "link_GB_s": 100.0, "all_ms": 1e6})  # not the Trainer's default
    (folder / "gpu_overlap.json").write_text(json.dumps({"variants": variants, "summary": summary}))


def test_measured_steps_are_compared_case_by_case_within_15_percent(tmp_path):
    cases = [gpu_plan_time.Case(f"single: {name}", "gpu_single", (name,), 10.0) for name in gpu_plan_time.SINGLE_SETUPS]
    cases += [
        gpu_plan_time.Case("overlap: W=1", "gpu_overlap", ("W1",), 20.0),
        gpu_plan_time.Case("overlap: W=2, 100 GB/s", "gpu_overlap", ("W2", 100.0), 30.0),
        gpu_plan_time.Case("overlap: W=2, 12.5 GB/s", "gpu_overlap", ("W2", 12.5), 30.0),  # not measured
    ]
    write_measured(tmp_path, single_ms=11.0, w1_ms=25.0, links_ms={100.0: 30.0})
    rows = gpu_plan_time.compare(cases, gpu_plan_time.measured(tmp_path))
    assert [(r["case"], r["ratio"], r["within_15%"]) for r in rows] == [
        (cases[0].name, pytest.approx(10 / 11, abs=1e-3), True),
        (cases[1].name, pytest.approx(10 / 11, abs=1e-3), True),
        ("overlap: W=1", 0.8, False),
        ("overlap: W=2, 100 GB/s", 1.0, True),
    ]


@pytest.mark.slow
def test_the_predictions_for_the_gpu_benchmarks_run_without_a_gpu():
    cases = {c.name: c.predicted_ms for c in gpu_plan_time.predictions("H100", SINGLE, OVERLAP)}
    plain, zero = (cases[f"single: {name}"] for name in gpu_plan_time.SINGLE_SETUPS)
    assert zero > 0 and plain > 0
    fast, slow = cases["overlap: W=2, 100 GB/s"], cases["overlap: W=2, 0.01 GB/s"]
    # at 10 MB/s the gradients' and params' bytes (2 x 2 bytes a param, half of them sent) are on the wire
    params = 2 * (12 * 64 * 64 + 13 * 64) + 50257 * 64 + 32 * 64
    assert slow - fast == pytest.approx(2 * params * 2 / 2 / 0.01e9 * 1e3, rel=0.5)
    assert cases["overlap: W=1"] <= fast
