"""What ``gpu_overlap.py`` measured, as fractions hidden, verdicts, tables and a plot.

    verdicts = write_report(out, context, times, links)   # out/gpu_overlap.{md,json,png}

``times[(setup, mode, link)]`` holds the ms per step of each round; a mode sleeps on nothing
(``none``), on the reduce-scatters (``rs``), on the all-gathers (``ag``) or on every collective
(``all``). Each fraction hidden pairs a round's run with the run of the same setup and link with
nothing sleeping just before it: ``1 - (sleeping - none) / wire``; the report gives the median and
range over the rounds.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

from benchmarks.common import markdown_table, write_results
from benchmarks.emulated_nccl import wire_seconds

TARGETS = {"rs": 0.90, "ag": 0.80}
KIND = {"rs": "reduce_scatter", "ag": "all_gather"}
COMPUTE = {"rs": "backward", "ag": "forward"}  # what each collective overlaps
W1 = "W=1"


def _spread(values: list[float]) -> tuple[float, float, float]:
    return statistics.median(values), min(values), max(values)


def hidden(times: dict, setup: str, mode: str, link: float, wire_ms: float) -> tuple[float, float, float]:
    """Median, lowest and highest fraction of ``wire_ms`` hidden over the rounds."""
    pairs = zip(times[(setup, mode, link)], times[(setup, "none", link)])
    return _spread([1 - (sleeping - none) / wire_ms for sleeping, none in pairs])


def verdict(mode: str, setup: str, overlap: bool | None, fraction: float, wire_ms: float, phases: dict) -> str:
    """The target's verdict: "pass", "FAIL" or why it does not apply."""
    if mode == "ag" and not overlap:
        return "n/a (not overlapped)"
    compute = phases[setup][COMPUTE[mode]]
    if wire_ms >= compute:
        return f"n/a (wire {wire_ms:.1f} ms >= {COMPUTE[mode]} {compute:.1f} ms)"
    return "pass" if fraction >= TARGETS[mode] else "FAIL"


def summarize(context: dict, times: dict, links) -> tuple[list[dict], list[dict], list[str]]:
    """Per-variant rows, per-(setup, link) summary rows and the verdict lines."""
    w1 = times[(W1, "none", None)]
    payload, phases = context["payload_bytes_per_step"], context["phases_ms"]
    rows = []
    for (setup, mode, link), ms in times.items():
        median, low, high = _spread(ms)
        ratio = statistics.median(a / b for a, b in zip(ms, w1))
        rows.append({"setup": setup, "mode": mode, "link_GB_s": link or "", "ms": median, "ms_low": low,
                     "ms_high": high, "vs_W1": ratio, "rounds_ms": ms})  # fmt: skip
    summary, lines = [], []
    overlap_of = {s: "overlap on" in s for s, _, _ in times if s != W1}
    for setup, overlap in overlap_of.items():
        for link in links:
            row = {"setup": setup, "link_GB_s": link}
            for mode in ("rs", "ag"):
                wire_ms = 1000 * wire_seconds(KIND[mode], payload.get(KIND[mode], 0), 2, link)
                fraction, low, high = hidden(times, setup, mode, link, wire_ms)
                judged = verdict(mode, setup, overlap, fraction, wire_ms, phases)
                row.update({f"{mode}_wire_ms": wire_ms, f"{mode}_hidden": fraction, f"{mode}_hidden_low": low,
                            f"{mode}_hidden_high": high, f"{mode}_target": judged})  # fmt: skip
                lines.append(
                    f"{setup}, {link:g} GB/s: {KIND[mode].replace('_', '-')} {fraction:.0%} hidden ({low:.0%} to "
                    f"{high:.0%}) of {wire_ms:.1f} ms: {judged}"
                    + (f" (target >= {TARGETS[mode]:.0%})" if judged in ("pass", "FAIL") else "")
                )
            every = times[(setup, "all", link)]
            row["none_ms"] = statistics.median(times[(setup, "none", link)])
            row["all_ms"] = statistics.median(every)
            row["all_vs_W1"] = statistics.median(a / b for a, b in zip(every, w1))
            summary.append(row)
    return rows, summary, lines


def _percent_range(row: dict, mode: str) -> str:
    return f"{row[f'{mode}_hidden']:.0%} ({row[f'{mode}_hidden_low']:.0%} to {row[f'{mode}_hidden_high']:.0%})"


def write_report(out: Path, context: dict, times: dict, links) -> list[str]:
    rows, summary, lines = summarize(context, times, links)
    model, settings = context["model"], context["settings"]
    smoke = settings["smoke"]
    title = "CPU SMOKE TEST (not GPU results): " if smoke else ""
    header = (
        f"# {title}Overlap on {context['machine']}, one device, a second rank emulated\n\n"
        f"`python benchmarks/gpu_overlap.py{' --cpu-smoke' if smoke else ''}` (torch {context['torch']}; "
        f"{context['seconds']:.0f} s): GPT-2 {model['n_layer']} x {model['n_embd']} ({model['params'] / 1e6:.3g}M "
        f"params), {settings['batch']} x {settings['seq']} tokens, bf16 params, fused AdamW, ZeRO stage 2, buckets of "
        f"{settings['bucket_mb']} MiB, rank 0 of 2 on `benchmarks/emulated_nccl.py`. Medians of {settings['rounds']} "
        f"interleaved rounds of {settings['steps']} steps, each block after an untimed step (`[Note: steady-state "
        f"blocks]` in `gpu_overlap.py`), {settings['warmup']} warm-up steps per setup; ranges in parentheses.\n\n"
        "Hidden = 1 - (step with that collective's sleeps - step with none) / its wire time per step (bytes a "
        "rank sends / link bandwidth). `none_ms`: nothing sleeping; `all_ms`: every collective sleeping; "
        "`all_vs_W1`: that against world size 1 in the same round."
        + (f"\n\n**{context['flag_note']}**" if context["flag_note"] else "")
    )
    table = [
        {"setup": r["setup"], "link GB/s": r["link_GB_s"], "RS wire ms": r["rs_wire_ms"],
         "RS hidden": _percent_range(r, "rs"), "RS target": r["rs_target"], "AG wire ms": r["ag_wire_ms"],
         "AG hidden": _percent_range(r, "ag"), "AG target": r["ag_target"], "none_ms": r["none_ms"],
         "all_ms": r["all_ms"], "all_vs_W1": r["all_vs_W1"]}
        for r in summary
    ]  # fmt: skip
    phase_rows = [{"setup": s, **{k: v for k, v in p.items()}} for s, p in context["phases_ms"].items()]
    variant_cols = ["setup", "mode", "link_GB_s", "ms", "ms_low", "ms_high", "vs_W1"]
    footer = (
        "\n## Phases, nothing sleeping (ms, median of 3 steps)\n\n"
        + markdown_table(phase_rows, ["setup", "forward", "backward", "step"])
        + "\n## Host syncs per phase of one step\n\n"
        + _syncs_text(context["host_syncs"])
        + "\n## Every run (ms per step)\n\n"
        + markdown_table(rows, variant_cols)
        + "\n## The sleeps against the bytes they stand for (one step per link, every sleep timed)\n\n"
        + markdown_table(context["sleeps"], ["link_GB_s", "kind", "nominal_ms", "slept_ms", "ratio"])
        + f"\nSleep kernel: {_cycles_text(context['sleep_cycles_per_s'])}.\n\n## Verdicts\n\n"
        + "\n".join(f"- {line}" for line in lines)
        + "\n"
    )
    columns = list(table[0])
    data = {"context": context, "summary": summary, "variants": rows, "verdicts": lines}
    write_results("gpu_overlap", table, columns, header, footer, data=data, directory=out)
    _plot(out / "gpu_overlap.png", summary, f"{title}{context['machine']}")
    return lines


def _syncs_text(syncs: list[dict]) -> str:
    if not syncs:
        return "Not counted: no CUDA device.\n"
    counts = [{"setup": s["setup"], **{p: s[p] for p in ("forward", "backward", "step", "gather")},
               "of them in hf_lowzero": json.dumps(s["ours"])} for s in syncs]  # fmt: skip
    sites = [{"setup": s["setup"], **site} for s in syncs for site in s["sites"]]
    table = markdown_table(counts, list(counts[0]))
    return table + ("\n" + markdown_table(sites, ["setup", "phase", "site", "syncs"]) if sites else "")


def _cycles_text(rates: list) -> str:
    if rates[0] is None:
        return "time.sleep on a worker thread (CPU)"
    drift = rates[1] / rates[0] - 1
    return f"{rates[0] / 1e9:.3f} G cycles/s calibrated before the runs, {rates[1] / 1e9:.3f} after ({drift:+.1%})"


def _plot(path: Path, summary: list[dict], title: str) -> None:
    try:
        import matplotlib
    except ImportError:
        print(f"matplotlib is not installed: no {path.name}")
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for setup in dict.fromkeys(r["setup"] for r in summary):
        mine = [r for r in summary if r["setup"] == setup]
        links = [r["link_GB_s"] for r in mine]
        for mode, style in (("rs", "-o"), ("ag", "--s")):
            values = [r[f"{mode}_hidden"] for r in mine]
            spans = [[v - r[f"{mode}_hidden_low"] for v, r in zip(values, mine)],
                     [r[f"{mode}_hidden_high"] - v for v, r in zip(values, mine)]]  # fmt: skip
            left.errorbar(links, values, yerr=spans, fmt=style, capsize=3, label=f"{KIND[mode]}, {setup}")
        right.plot(links, [r["all_vs_W1"] for r in mine], "-o", label=setup)
    links = sorted({r["link_GB_s"] for r in summary})
    for axis in (left, right):
        axis.set_xscale("log", base=2)
        axis.set_xticks(links, [f"{link:g}" for link in links])
        axis.minorticks_off()
        axis.set_xlabel("link GB/s")
    fractions = [r[f"{mode}_hidden"] for r in summary for mode in ("rs", "ag")]
    left.set_ylim(max(-0.5, min(fractions) - 0.05), min(1.5, max(fractions) + 0.05))  # past that: noise, in the table
    left.axhline(TARGETS["rs"], color="k", lw=0.6, ls=":")
    left.axhline(TARGETS["ag"], color="k", lw=0.6, ls=":")
    left.set_ylabel("fraction of wire time hidden")
    left.legend(fontsize=7)
    right.axhline(1.0, color="k", lw=0.6)
    right.set_ylabel("step time, every collective sleeping / W=1")
    right.legend(fontsize=7)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
