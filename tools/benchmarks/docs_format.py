"""What every section of docs/benchmarks.md is rendered with: the JSON results and hand-written
notes of docs/bench/, a sitting's load line, and the latency table of a set of runs."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def read_json(out: Path, name: str) -> dict[str, Any] | None:
    path = out / f"{name}.json"
    return json.loads(path.read_text()) if path.is_file() else None


def read_note(out: Path, name: str) -> str:
    path = out / "notes" / f"{name}.md"
    return path.read_text().strip() + "\n\n" if path.is_file() else ""


def ms(x: float) -> str:
    return f"{x * 1e3:.0f}" if x >= 0.01 else f"{x * 1e3:.1f}"


def load_line(loads: dict[str, Any], step: str) -> str:
    entry = loads.get(step)
    if not entry:
        return ""
    b, a = entry["load_before"], entry["load_after"]
    return (
        f"*Run {entry['date']}, {entry['minutes']} min; load average (1/5/15 min) "
        f"before {b[0]:.1f}/{b[1]:.1f}/{b[2]:.1f}, after {a[0]:.1f}/{a[1]:.1f}/{a[2]:.1f} "
        f"on 2 cores.*\n\n"
    )


def latency_table(runs: list[tuple[str, dict[str, Any]]]) -> str:
    rows = [
        "| run | ok/failed | duration s | out tok/s | TTFT p50/p99 ms | TPOT p50/p99 ms "
        "| ITL p50/p99 ms | E2E p50/p99 s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, s in runs:
        rows.append(
            f"| {name} | {s['completed']}/{s['failed']} | {s['duration_s']:.1f} | "
            f"{s['output_tok_s']:.1f} | {ms(s['ttft_s']['median'])} / {ms(s['ttft_s']['p99'])}"
            f" | {ms(s['tpot_s']['median'])} / {ms(s['tpot_s']['p99'])} | "
            f"{ms(s['itl_s']['median'])} / {ms(s['itl_s']['p99'])} | "
            f"{s['e2e_s']['median']:.2f} / {s['e2e_s']['p99']:.2f} |"
        )
    return "\n".join(rows) + "\n\n"
