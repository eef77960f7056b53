"""The scheduler's figures side by side in one run, on one mixed workload:

- continuous vs static vs dynamic batching, all requests at once and as a Poisson stream;
- TTFT with and without a shared 512-token system prompt (prefix cache on);
- step time with and without overlapped (async) scheduling.

    .venv/bin/python -m tools.benchmarks.scheduling --json docs/bench/scheduling.json

Prints a markdown table per question (pasted into docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from tools.benchmarks import cli


def _run(name: str, common: list[str], extra: list[str], server_flags: str) -> dict[str, Any]:
    out = Path(f"/tmp/bench-sched-{name.replace(' ', '').replace(',', '-')}.json")
    argv = [*common, *extra, "--server-flags", server_flags, "--json", str(out)]
    print(f"== {name}: tools/bench {' '.join(argv)}", flush=True)
    cli.main(argv)
    result = json.loads(out.read_text())
    result["name"] = name
    return result


def _row(r: dict[str, Any]) -> str:
    s, st = r["shuttle"], r.get("server_stats", {})
    return (
        f"| {r['name']} | {s['completed']}/{s['completed'] + s['failed']} | "
        f"{s['output_tok_s']:.1f} | {s['ttft_s']['median'] * 1e3:.0f} | "
        f"{s['ttft_s']['p99'] * 1e3:.0f} | {s['tpot_s']['median'] * 1e3:.0f} | "
        f"{s['e2e_s']['median']:.1f} | {st.get('mean_step_interval_s', 0) * 1e3:.0f} | "
        f"{st.get('mean_step_forward_s', 0) * 1e3:.0f} | "
        f"{st.get('prefix_cache_hits', 0)}/{st.get('prefix_cache_queries', 0)} |"
    )


HEADER = (
    "| config | ok | out tok/s | TTFT p50 ms | TTFT p99 ms | TPOT p50 ms | E2E p50 s | "
    "step interval ms | step forward ms | prefix hits/queries (tokens) |\n"
    "|---|---|---|---|---|---|---|---|---|---|"
)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--input-len", default="32:256")
    p.add_argument("--output-len", default="16:96")
    p.add_argument("--rate", type=float, default=2.0, help="Poisson arrivals per second")
    p.add_argument("--json", default="")
    p.add_argument(
        "--only",
        default="",
        help="comma list of: batching, prefix, overlap (others are kept from --json's file)",
    )
    args = p.parse_args(argv)
    only = set(filter(None, args.only.split(","))) or {"batching", "prefix", "overlap"}
    common = [
        "--num-prompts",
        str(args.num_prompts),
        "--input-len",
        args.input_len,
        "--output-len",
        args.output_len,
        "--seed",
        "1",
    ]
    base = "--max-num-seqs 32 --max-num-batched-tokens 512"
    runs: dict[str, list[dict[str, Any]]] = {"batching": [], "prefix": [], "overlap": []}
    if args.json and Path(args.json).is_file():
        runs.update(
            {k: v for k, v in json.loads(Path(args.json).read_text()).items() if k not in only}
        )
    if "batching" in only:
        for policy in ("continuous", "static", "dynamic"):
            for arrival, extra in (("burst", []), ("poisson", ["--rate", str(args.rate)])):
                runs["batching"].append(
                    _run(f"{policy}-{arrival}", common, extra, f"{base} --batch-policy {policy}")
                )
    if "prefix" in only:
        # every prompt starts with the same 512 tokens: the cache on, then off; and the
        # same arrival of prompts without the shared part, for scale
        for name, shared, flag in (
            ("no-shared-prefix", 0, ""),
            ("shared-prefix-512, cache on", 512, ""),
            ("shared-prefix-512, cache off", 512, " --no-enable-prefix-caching"),
        ):
            runs["prefix"].append(
                _run(
                    name,
                    common,
                    ["--shared-prefix", str(shared), "--rate", str(args.rate)],
                    base + flag,
                )
            )
    if "overlap" in only:
        for overlap in ("--async-scheduling", "--no-async-scheduling"):
            runs["overlap"].append(_run(overlap.strip("-"), common, [], f"{base} {overlap}"))
    for title, rs in runs.items():
        print(f"\n### {title}\n\n{HEADER}")
        for r in rs:
            print(_row(r))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(runs, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
