"""tools/bench PNG plots (matplotlib, no display): latency CDFs, a rate sweep, throughput bars.

    latency_cdf.png   CDFs of TTFT, TPOT, ITL and E2E, one line per run (e.g. per rate)
    rate_sweep.png    output tokens/s against p99 TTFT and p99 TPOT, one point per rate
    throughput.png    output tokens/s of shuttle and of each baseline

`python -m tools.benchmarks.plots RESULT.json OUT_DIR` redraws them from a --json result.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from tools.benchmarks.report import Timing, timings_from_json

_METRICS = (
    ("TTFT", lambda ts: [t.ttft for t in ts]),
    ("TPOT", lambda ts: [t.tpot for t in ts if t.output_tokens > 1]),
    ("ITL", lambda ts: [x for t in ts for x in t.itl]),
    ("E2E", lambda ts: [t.e2e for t in ts]),
)


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")  # files only: no display on a server
    import matplotlib.pyplot as plt

    return plt


def latency_cdf(runs: list[tuple[str, list[Timing]]], path: Path, title: str = "") -> Path:
    """One panel per metric, one CDF line per (label, timings) run; milliseconds."""
    plt = _pyplot()
    fig, axes = plt.subplots(2, 2, figsize=(10, 7))
    for ax, (name, values_of) in zip(axes.flat, _METRICS, strict=True):
        for label, timings in runs:
            xs = sorted(x * 1e3 for x in values_of([t for t in timings if not t.error]))
            if not xs:
                continue
            ys = [(i + 1) / len(xs) for i in range(len(xs))]
            ax.step(xs, ys, where="post", label=label)
            if xs[0] > 0 and xs[-1] / xs[0] > 50:
                ax.set_xscale("log")
        ax.set_xlabel(f"{name} (ms)")
        ax.set_ylabel("fraction of " + ("tokens" if name == "ITL" else "requests"))
        ax.grid(True, alpha=0.3)
        if len(runs) > 1:
            ax.legend(fontsize=7)
    fig.suptitle(title or "latency CDFs")
    fig.tight_layout()
    return _save(fig, path, plt)


def rate_sweep(sweep: list[dict[str, Any]], path: Path, title: str = "") -> Path:
    """Throughput against p99 TTFT (left) and p99 TPOT (right); points labelled by rate."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    xs = [s["output_tok_s"] for s in sweep]
    for ax, key, name in ((axes[0], "ttft_s", "TTFT"), (axes[1], "tpot_s", "TPOT")):
        ys = [s[key]["p99"] * 1e3 for s in sweep]
        ax.plot(xs, ys, marker="o")
        for x, y, s in zip(xs, ys, sweep, strict=True):
            ax.annotate(
                f"{s['rate']:g}/s", (x, y), textcoords="offset points", xytext=(4, 4), fontsize=8
            )
        ax.set_xlabel("output tokens/s")
        ax.set_ylabel(f"p99 {name} (ms)")
        ax.grid(True, alpha=0.3)
    fig.suptitle(title or "request rate sweep")
    fig.tight_layout()
    return _save(fig, path, plt)


def throughput_bars(result: dict[str, Any], path: Path, title: str = "") -> Path:
    """Useful output tokens/s: shuttle beside its baselines."""
    plt = _pyplot()
    rows = [(result["shuttle"]["name"], result["shuttle"]["output_tok_s"])]
    rows += [(b["name"], b["output_tok_s"]) for b in result.get("baselines", [])]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    bars = ax.bar(
        [r[0] for r in rows],
        [r[1] for r in rows],
        color=["tab:blue"] + ["tab:gray"] * (len(rows) - 1),
    )
    ax.bar_label(bars, fmt="%.1f")
    ax.set_ylabel("useful output tokens/s")
    ax.set_title(title or "throughput, same requests")
    fig.tight_layout()
    return _save(fig, path, plt)


def _save(fig: Any, path: Path, plt: Any) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_result(result: dict[str, Any], out_dir: str | Path, prefix: str = "") -> list[Path]:
    """Every plot a --json result holds data for; returns the files written."""
    out = Path(out_dir)
    runs = [
        (
            f"rate {r['rate']:g}/s" if r.get("rate") != "inf" else "burst",
            timings_from_json(r["requests"]),
        )
        for r in result.get("sweep", [])
        if "requests" in r
    ]
    if not runs and "requests" in result["shuttle"]:
        runs = [("shuttle", timings_from_json(result["shuttle"]["requests"]))]
    written = []
    if runs:
        written.append(latency_cdf(runs, out / f"{prefix}latency_cdf.png"))
    if len(result.get("sweep", [])) > 1:
        written.append(rate_sweep(result["sweep"], out / f"{prefix}rate_sweep.png"))
    if result.get("baselines"):
        written.append(throughput_bars(result, out / f"{prefix}throughput.png"))
    return written


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) not in (2, 3):
        print(
            "usage: python -m tools.benchmarks.plots RESULT.json OUT_DIR [PREFIX]", file=sys.stderr
        )
        return 2
    for path in plot_result(json.loads(Path(args[0]).read_text()), args[1], *args[2:]):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
