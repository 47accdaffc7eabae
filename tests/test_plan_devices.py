"""``python -m hf_lowzero.trainer.plan_cli`` without ``--device-memory``: on a machine with a GPU, the plan for that
GPU (only the device-size query is faked here); elsewhere every setup's peak and the smallest common
device it fits, checked against the planner's own peaks."""

from __future__ import annotations

import contextlib
import io
import json
import os
import types

import pytest
import torch

from hf_lowzero import LowZeroTrainingArguments
from hf_lowzero.plan import devices
from hf_lowzero.plan.devices import COMMON_DEVICES, GIB, plan_devices, smallest_device, this_gpu
from hf_lowzero.plan.measure import tiny_model_spec
from hf_lowzero.plan.request import RESERVE
from hf_lowzero.trainer.plan_cli import main as plan_main

MIB = 2**20
ARGV = ["--world-size", "2", "--seq-len", "32", "--backend", "gloo", "--per_device_train_batch_size", "2"]


def expected_smallest(peak: int, sizes=COMMON_DEVICES, reserve: float = RESERVE) -> int | None:
    """The rule, written out: the smallest listed size whose usable part (90%) holds the peak."""
    usable = sorted(size for size in sizes if peak <= size * (1 - reserve))
    return usable[0] if usable else None


@pytest.fixture(scope="module")
def plans(tmp_path_factory) -> dict[str, tuple[str, dict]]:
    """The command's (stdout, JSON) for the tiny GPT-2 on 2 CPU ranks: without a device size and
    without a GPU, without a device size on a machine whose GPU 0 has 12 MiB (faked: the size query
    only), and with ``--device-memory 12MiB``."""
    folder = tmp_path_factory.mktemp("plans")
    tiny_model_spec("gpt2").config.save_pretrained(folder / "model")
    gpus = {"no device, no GPU": None, "no device, a GPU": ("Fake GPU", 12 * MIB), "12MiB": None}
    out = {}
    with pytest.MonkeyPatch.context() as patch:
        for name, gpu in gpus.items():
            patch.setattr(devices, "this_gpu", lambda gpu=gpu: gpu)
            path = folder / f"{len(out)}.json"
            sized = ["--device-memory", name] if name == "12MiB" else []
            stdout = io.StringIO()  # capsys is per test; the plans are shared
            with contextlib.redirect_stdout(stdout):
                status = plan_main(["--model", str(folder / "model"), *ARGV, *sized, "--json", str(path)])
            assert status == 0, stdout.getvalue()
            out[name] = (stdout.getvalue(), json.loads(path.read_text()))
    return out


def test_smallest_device_is_the_smallest_listed_size_whose_usable_part_holds_the_peak():
    assert [size // GIB for size in COMMON_DEVICES] == [16, 24, 40, 48, 80, 141]
    for peak in (1, int(0.9 * 16 * GIB), int(0.9 * 16 * GIB) + 1, 30 * GIB, int(0.9 * 141 * GIB), 127 * GIB):
        assert smallest_device(peak) == expected_smallest(peak), peak
    assert smallest_device(int(0.9 * 16 * GIB)) == 16 * GIB  # the boundary: 90% of the device
    assert smallest_device(int(0.9 * 16 * GIB) + 1) == 24 * GIB
    assert smallest_device(127 * GIB) is None  # beyond 90% of 141 GiB: none of these
    assert smallest_device(15 * GIB, reserve=0.0) == 16 * GIB


def test_without_a_device_or_a_gpu_the_plan_names_each_setups_smallest_device(plans):
    text, saved = plans["no device, no GPU"]
    _, sized = plans["12MiB"]
    rows = saved["rows"]
    assert [r["label"] for r in rows] == [
        "stage 0 (DDP)",
        "stage 1",
        "stage 1 + offload",
        "stage 2",
        "stage 2 + offload",
    ]
    # the peaks are the planner's at any device size ([Note: peaks without a device])
    assert [r["peak_bytes"] for r in rows] == [r["peak_bytes"] for r in sized["rows"]]
    assert saved["device_sizes"] == list(COMMON_DEVICES) and saved["reserve"] == RESERVE
    for row in rows:
        assert row["smallest_device_bytes"] == expected_smallest(row["peak_bytes"]) == 16 * GIB, row["label"]
    assert "no device size given: each setup's peak and the smallest of 16, 24, 40, 48, 80, 141 GiB it fits" in text
    table = [line for line in text.split("\nTime on")[0].splitlines() if line.startswith("stage ")]  # not the times
    assert len(table) == 5 and all(line.endswith(" 16 GiB") for line in table)


def test_the_smallest_device_from_any_list_and_none_of_these(plans):
    """Sizes around the planner's own peaks: the offloaded setups fit the middle one, the others only
    the largest; with the largest left out, those fit none of these."""
    peaks = {r["label"]: r["peak_bytes"] for r in plans["no device, no GPU"][1]["rows"]}
    low, high = min(peaks.values()), max(peaks.values())
    assert low < high  # offload moves the optimizer state off the device
    sizes = (low // 2, int(low / (1 - RESERVE)) + 1, int(high / (1 - RESERVE)) + 1)
    args = LowZeroTrainingArguments(output_dir=os.devnull, use_cpu=True, report_to=[], per_device_train_batch_size=2)
    for given in (sizes, sizes[:2]):
        fits = plan_devices(tiny_model_spec("gpt2").config, args, world_size=2, seq_len=32, backend="gloo", sizes=given)
        assert {r.label: r.peak_bytes for r in fits.plan.rows} == peaks  # the command's plan
        for label, peak in peaks.items():
            assert fits.smallest[label] == expected_smallest(peak, given), label
    assert fits.smallest["stage 2 + offload"] == fits.smallest["stage 1 + offload"] == sizes[1]
    assert fits.smallest["stage 2"] is None and fits.fits_any
    assert sum(line.endswith(" none of these") for line in fits.to_text().splitlines()) == 3


def test_on_a_machine_with_a_gpu_the_plan_is_for_that_gpu(plans):
    text, saved = plans["no device, a GPU"]
    sized_text, sized = plans["12MiB"]
    assert text.startswith("Planning for this machine's GPU 0, Fake GPU (12.00 MiB); --device-memory SIZE plans")
    assert saved == sized  # the plan of --device-memory 12MiB, row for row
    assert saved["device_memory"] == 12 * MIB and saved["recommended"] is not None
    assert text.split("\n\n", 1)[1] == sized_text


def test_this_gpu_is_gpu_0s_name_and_total_memory(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert this_gpu() is None
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    asked = []

    def properties(index):
        asked.append(index)
        return types.SimpleNamespace(name="NVIDIA H100 80GB HBM3", total_memory=85029158912)

    monkeypatch.setattr(torch.cuda, "get_device_properties", properties)
    assert this_gpu() == ("NVIDIA H100 80GB HBM3", 85029158912) and asked == [0]


def test_the_plan_refuses_a_device_size_without_a_size_plan():
    with pytest.raises(ValueError, match="device_memory is given"):
        plan_devices(tiny_model_spec("gpt2").config, device_memory="1GiB")
