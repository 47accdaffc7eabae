"""Beyond a single run (issue 56): ``--world-size 1,2`` plans each size and prints a scaling table,
``--price-per-device-hour`` a cost per setup and per size. Checked against the plans' own records: each
size's row is that size's plan's recommended row (the plan of ``--world-size N`` alone), efficiency is the
tokens/s ratio over the world-size ratio, the cost is devices x hours x price. A single ``--world-size``
prints what it always did: no scaling, no price, no cost.

The tiny GPT-2 on CPU ranks, timed for a ``cpu`` of fixed figures (``tests/test_timing.py``'s), one
rank to a node behind a slow network, so the second rank's collectives cross nodes.
"""

from __future__ import annotations

import contextlib
import copy
import io
import json
import math

import pytest

from hf_lowzero.plan.cost import Price
from hf_lowzero.plan.measure import tiny_model_spec
from hf_lowzero.plan.scaling import parse_world_sizes
from hf_lowzero.timing import calibrate
from hf_lowzero.trainer.plan_cli import main as plan_main
from tests.test_timing import FIXED_CPU

PRICE, TOKENS = 2.5, 1e6
ARGV = ["--seq-len", "32", "--device", "cpu", "--gpus-per-node", "1", "--inter-node", "0.1GB/s", "--device-memory",
        "1GiB", "--host-threads", "1", "--bf16", "--per_device_train_batch_size", "2"]  # fmt: skip


@pytest.fixture(scope="module")
def model_folder(tmp_path_factory):
    """The tiny GPT-2's config and a ``cpu`` of fixed figures in the calibration's cache."""
    folder = tmp_path_factory.mktemp("scaling")
    tiny_model_spec("gpt2").config.save_pretrained(folder / "model")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(calibrate.CACHE_ENV, str(folder / "cache"))
        calibrate.cache_path().parent.mkdir(parents=True)
        calibrate.cache_path().write_text(json.dumps(FIXED_CPU))
        yield folder


def run_plan(folder, sizes: str, *extra: str) -> tuple[str, dict]:
    """The command's (stdout, JSON) for ``--world-size sizes``."""
    path = folder / f"{sizes}{len(extra)}.json"
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):
        argv = ["--model", str(folder / "model"), "--world-size", sizes, *ARGV, *extra, "--json", str(path)]
        assert plan_main(argv) == 0, stdout.getvalue()
    return stdout.getvalue(), json.loads(path.read_text())


@pytest.fixture(scope="module")
def plans(model_folder) -> dict[str, tuple[str, dict]]:
    """The command's (stdout, JSON) for ``--world-size 2``, and ``--world-size 1,2`` with a price."""
    price = ["--price-per-device-hour", str(PRICE), "--tokens", "1e6"]
    return {"2": run_plan(model_folder, "2"), "1,2": run_plan(model_folder, "1,2", *price)}


def test_each_sizes_row_is_its_plans_and_efficiency_is_against_linear(plans):
    text, scaled = plans["1,2"]
    two = plans["2"][1]
    rows = scaled["scaling"]
    assert [r["world_size"] for r in rows] == [1, 2] and [r["nodes"] for r in rows] == [1, 2]  # 1 per node
    assert_row_is_the_plans(rows[1], two)
    assert rows[0]["efficiency"] == 1.0
    expected = (rows[1]["tokens_per_s"] / rows[0]["tokens_per_s"]) / (2 / 1)
    assert rows[1]["efficiency"] == pytest.approx(expected)
    assert rows[1]["efficiency"] < 1  # the second rank's collectives cross a 0.1 GB/s network
    # the largest size's plan, in full, is the plan of that size alone (with the price's cost added)
    bare = {k: copy.deepcopy(v) for k, v in scaled.items() if k not in ("scaling", "price")}
    for row in [*bare["rows"], bare["recommended"]]:
        row.pop("cost")
    assert bare == two
    assert "Scaling on cpu (1 per node, " in text and "0.1 GB/s between nodes" in text
    # the scaling table alone: no size's plan in full, and where to find one
    assert text.startswith("Scaling on cpu") and "Memory plan:" not in text and "Time on" not in text
    assert text.rstrip().endswith("the same command with one --world-size (1, 2); --json holds the largest size's "
                                  "plan in full.")  # fmt: skip
    table = text.split("Scaling on cpu")[1].splitlines()[3:]
    for row, line in zip(rows, table):
        cells = line.split()
        assert cells[:2] == [str(row["world_size"]), str(row["nodes"])]
        assert f"{row['tokens_per_s']:,.0f}" in line and f"{row['efficiency']:.1%}" in line


@pytest.mark.slow
def test_the_smallest_sizes_row_is_its_plan_alone(model_folder, plans):
    """The base of the efficiency, the one-rank row, against ``--world-size 1`` alone (a fourth plan)."""
    _, one = run_plan(model_folder, "1")
    assert_row_is_the_plans(plans["1,2"][1]["scaling"][0], one)
    assert "scaling" not in one and "price" not in one


def assert_row_is_the_plans(row: dict, alone: dict) -> None:
    """A scaling row holds the recommended row of its size's plan, ``alone``."""
    best = alone["recommended"]
    assert (row["setup"], row["stage"], row["offload"]) == (best["setup"], best["stage"], best["offload"])
    assert row["step_time_s"] == best["step_time_s"]
    assert row["tokens_per_s_per_device"] == best["tokens_per_s"]
    assert row["tokens_per_s"] == pytest.approx(best["tokens_per_s"] * alone["world_size"])


def test_the_cost_is_devices_times_hours_times_the_price(plans):
    text, scaled = plans["1,2"]
    assert scaled["price"] == {"per_device_hour": PRICE, "tokens": TOKENS}
    for row in scaled["rows"]:  # the largest size's setups
        hours = TOKENS / (row["tokens_per_s"] * scaled["world_size"]) / 3600
        assert row["cost"] == pytest.approx(scaled["world_size"] * hours * PRICE), row["setup"]
    for row in scaled["scaling"]:
        hours = TOKENS / row["tokens_per_s"] / 3600
        assert row["cost"] == pytest.approx(row["world_size"] * hours * PRICE)
    assert scaled["scaling"][1]["cost"] == scaled["recommended"]["cost"]  # the same setup at the same size
    assert Price.of(PRICE, TOKENS).cost(devices=4, tokens_per_s=1000.0) == pytest.approx(4 * 1e6 / 1000 / 3600 * 2.5)
    assert text.count("cost of 1M tokens at 2.5/device-hour") == 1  # the scaling table's column


def test_a_single_world_size_prints_what_it_always_did(plans):
    text, saved = plans["2"]
    assert "scaling" not in saved and "price" not in saved
    assert all("cost" not in row for row in saved["rows"]) and "cost" not in saved["recommended"]
    assert "Scaling" not in text and "cost of" not in text
    assert text.startswith("Memory plan: ") and "World size 2, 1.00 GiB per device" in text


BAD = [
    (["--world-size", "8,x"], "world_size='8,x' is invalid: 'x' is not a world size"),
    (["--world-size", "0"], "world_size='0' is invalid: '0' is not a world size"),
    (["--world-size", "4,4"], "world_size='4,4' is invalid: 4 is given twice"),
    (["--price-per-device-hour", "-1"], "price_per_device_hour='-1' is invalid; expected a price per device"),
    (["--price-per-device-hour", "0"], "price_per_device_hour='0' is invalid"),
    (["--price-per-device-hour", "abc"], "price_per_device_hour='abc' is invalid"),
    (["--price-per-device-hour", "nan"], "price_per_device_hour='nan' is invalid"),
    (["--price-per-device-hour", "2", "--tokens", "0"], "tokens='0' is invalid; expected a number of tokens"),
    (["--price-per-device-hour", "2", "--tokens", "lots"], "tokens='lots' is invalid"),
    (["--tokens", "1e9"], "--tokens 1e9 names the tokens --price-per-device-hour prices; give the price too"),
    (
        ["--world-size", "2,4", "--device", "cpu"],
        "--world-size 2,4 compares the recommended setup at each size, which needs a device",
    ),
]


@pytest.mark.parametrize("flags, message", BAD, ids=[" ".join(f) for f, _ in BAD])
def test_bad_scaling_and_price_flags_get_one_line_before_anything_runs(tmp_path, capsys, flags, message):
    """Refused before the model is read: the folder named does not even exist."""
    with pytest.raises(SystemExit) as exited:
        plan_main(["--model", str(tmp_path / "no such model"), *flags])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and message in err, err
    assert list(tmp_path.iterdir()) == []


def test_world_sizes_are_read_from_a_list_or_one_number():
    assert parse_world_sizes("8, 16,32") == [8, 16, 32] and parse_world_sizes(4) == [4] == parse_world_sizes("4")
    assert parse_world_sizes([2, 1]) == [2, 1]
    for bad in (True, "", "8,", "-2", "1.5", [0]):
        with pytest.raises(ValueError, match="is invalid"):
            parse_world_sizes(bad)
    assert math.isclose(Price.of("2.5", "2B").tokens, 2e9) and Price.of(1, "500M").tokens == 5e8
    with pytest.raises(ValueError, match="price_per_device_hour='2B' is invalid"):
        Price.of("2B")  # a suffix is for tokens only
