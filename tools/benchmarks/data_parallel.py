"""Data parallelism: prefix-aware routing against round-robin, in one sitting.

A shared-prefix workload (many users behind a few long system prompts, in random order) is
sent to `shuttle serve --data-parallel-size 2`, once per routing, same prompts, same arrivals:
the prefix-cache hit rate (prompt tokens found cached / prompt tokens looked up, from every
replica's counters) and the TTFT percentiles. Each replica's KV cache is sized (with
--kv-cache-memory) to hold about half the system prompts, as on a server whose cache is
precious: round-robin makes every replica hold every prompt, prefix routing one half each.

    .venv/bin/python -m tools.benchmarks.data_parallel [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import shlex
import sys
from pathlib import Path
from typing import Any

import httpx
import orjson

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from common.prepare_model import prepare_default_model  # noqa: E402
from tests.server import running_server  # noqa: E402
from tools.benchmarks.load import run_load  # noqa: E402
from tools.benchmarks.report import per_request, summarize  # noqa: E402
from tools.benchmarks.workload import Workload  # noqa: E402

TOKEN = "bench"


def shared_prefix_workload(args: argparse.Namespace, vocab: int) -> Workload:
    """`num_users` requests; each starts with one of `num_systems` system prompts of
    `system_len` tokens (drawn at random), then its own `user_len` tokens."""
    rng = random.Random(args.seed)
    word = lambda: rng.randrange(1000, vocab - 1000)  # noqa: E731
    systems = [[word() for _ in range(args.system_len)] for _ in range(args.num_systems)]
    prompts: list[list[int] | str] = [
        rng.choice(systems) + [word() for _ in range(args.user_len)] for _ in range(args.num_users)
    ]
    return Workload(prompts, [args.output_len] * args.num_users)


def _stats(url: str) -> dict[str, Any]:
    r = httpx.get(url + "/admin/stats", headers={"Authorization": f"Bearer {TOKEN}"}, timeout=30)
    return dict(r.json())


def run_one(
    routing: str, args: argparse.Namespace, wl: Workload, load_bound: float = 1.25
) -> dict[str, Any]:
    flags = [
        "--data-parallel-size", "2", "--dp-routing", routing, "--admin-token", TOKEN,
        "--dp-load-bound", str(load_bound),
        "--num-threads", str(args.threads), "--kv-cache-memory", str(args.kv_cache_memory),
        *shlex.split(args.server_flags),
    ]  # fmt: skip
    with running_server(*flags) as server:
        model = server.model
        timings, duration, peak = asyncio.run(
            run_load(server.url, model, wl, args.concurrency, args.rate, args.seed)
        )
        stats = _stats(server.url)
    summary = summarize(timings, duration, peak, wl)
    replicas = [
        {
            "replica": r["replica"],
            "prefix_cache_queries": r.get("prefix_cache_queries", 0),
            "prefix_cache_hits": r.get("prefix_cache_hits", 0),
            "num_preemptions": r.get("num_preemptions", 0),
        }
        for r in stats["replicas"]
    ]
    return {
        "routing": routing,
        "load_bound": load_bound if routing == "prefix" else None,
        "server_flags": " ".join(flags),
        "prefix_hit_rate": stats["prefix_cache_hits"] / max(1, stats["prefix_cache_queries"]),
        "replicas": replicas,
        **{k: summary[k] for k in ("completed", "failed", "duration_s", "ttft_s", "e2e_s")},
        "request_throughput": summary["request_throughput"],
        "requests": per_request(timings),
    }


def markdown(result: dict[str, Any]) -> str:
    """The docs/benchmarks.md table of one sitting."""
    w = result["workload"]
    load = result.get("load_before"), result.get("load_after")
    text = (
        f"{w['num_users']} requests, each one of {w['num_systems']} system prompts of "
        f"{w['system_len']} tokens (random ids, seed {w['seed']}) and {w['user_len']} tokens "
        f"of its own, {w['output_len']} output tokens; {w['concurrency'] or 'all'} in flight "
        f"at a time; 2 replicas of SmolLM2 fp32, {w['threads']} thread each, "
        f"{w['kv_cache_memory']} GiB of KV each; load average before/after "
        f"{load[0][0] if load[0] else '?'} / {load[1][0] if load[1] else '?'}.\n\n"
        "| routing | prefix hit rate | hits per replica (tokens) | TTFT p50 | TTFT p90 | "
        "E2E p50 | failed |\n|---|---|---|---|---|---|---|\n"
    )
    for run in result["runs"]:
        name = run["routing"] + (
            f" (bound {run['load_bound']:g})" if run.get("load_bound") is not None else ""
        )
        hits = " / ".join(f"{r['prefix_cache_hits']}" for r in run["replicas"])
        text += (
            f"| {name} | {run['prefix_hit_rate']:.1%} | {hits} | "
            f"{run['ttft_s']['median'] * 1e3:.0f} ms | {run['ttft_s']['p90'] * 1e3:.0f} ms | "
            f"{run['e2e_s']['median'] * 1e3:.0f} ms | {run['failed']} |\n"
        )
    return text


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m tools.benchmarks.data_parallel")
    p.add_argument("--num-users", type=int, default=64, help="requests")
    p.add_argument("--num-systems", type=int, default=8, help="distinct system prompts")
    p.add_argument("--system-len", type=int, default=512, help="tokens of a system prompt")
    p.add_argument("--user-len", type=int, default=32, help="tokens after the system prompt")
    p.add_argument("--output-len", type=int, default=8)
    p.add_argument("--rate", type=float, default=2.0, help="Poisson arrivals per s")
    p.add_argument("--concurrency", type=int, default=0, help="most in flight (0: no cap)")
    p.add_argument(
        "--kv-cache-memory",
        type=float,
        default=0.1,
        help="GiB of KV per replica (0.1: ~2,300 SmolLM2 tokens, half the system prompts)",
    )
    p.add_argument("--threads", type=int, default=1, help="torch threads per worker")
    p.add_argument("--server-flags", default="", help="more flags for both servers")
    p.add_argument("--routings", default="prefix,round-robin")
    p.add_argument(
        "--load-bounds", default="1.25", help="comma list: one prefix-routing run per bound"
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default="")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    model_dir = prepare_default_model()
    vocab = orjson.loads((Path(model_dir) / "config.json").read_bytes())["vocab_size"]
    wl = shared_prefix_workload(args, vocab)
    load_before = os.getloadavg()
    runs = []
    for routing in args.routings.split(","):
        bounds = args.load_bounds.split(",") if routing == "prefix" else ["1.25"]
        runs += [run_one(routing, args, wl, float(b)) for b in bounds]
    result = {
        "workload": vars(args),
        "load_before": load_before,
        "load_after": os.getloadavg(),
        "runs": runs,
    }
    print(markdown(result))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_bytes(orjson.dumps(result, option=orjson.OPT_INDENT_2))
    return 0 if all(r["failed"] == 0 for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
