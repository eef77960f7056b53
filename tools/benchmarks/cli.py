"""tools/bench: load an OpenAI-compatible server and measure it, beside transformers baselines.

    tools/bench --num-prompts 16 --input-len 128 --output-len 64 --baseline hf-static
    tools/bench --url http://127.0.0.1:8000 --input-len 32:512 --output-len 16:256 --rate 4
    tools/bench --jsonl prompts.jsonl --sweep-rates 1,2,4,8 --plot-dir out/ --slo-ttft-ms 500
    tools/bench --server-flags "--model synthetic" --num-prompts 256 --output-len 200
    tools/bench --compare shuttle,vllm,llamacpp --json out/peers.json    (peers.py)
    tools/bench --workload multi-turn --conversations 16 --turns 6 --concurrency 2 \
        --output-len 16 --admin-token t    # chat conversations: the prefix cache's hit rate
    tools/bench --workload bursts --streams 8 --burst-size 2 --input-len 1024:2048 \
        --server-flags "--num-threads 2"  # decode streams' ITL while long prompts arrive
    tools/bench --num-prompts 64 --input-len 32:512 --output-len 16:256 \
        --logprobs 5 --repetition-penalty 1.1     # the mixed load, every request asking
    tools/bench --num-prompts 64 --input-len 32:512 --output-len 16:256 \
        --structured-share 0.5                    # half of it under a JSON schema

(`tools/bench` runs `python -m tools.benchmarks`, this module.) Prompts are random token ids
(as `vllm bench serve --dataset-name random`), optionally behind a shared prefix, or the
lines of a JSONL file (workload.py); they go to /v1/completions with `ignore_eos`, streamed,
so TTFT and every inter-token gap are seen (load.py). Arrivals: all at once (default),
Poisson at --rate, capped by --concurrency, or one run per rate of --sweep-rates. Without
--url a shuttle server is started here (and stopped) with --server-flags. Baselines run
afterwards on the same prompts and lengths, in this process, same dtype and threads
(baselines.py). --logprobs N and --repetition-penalty X make every request ask for them
(`logprobs: N`, the completions form of top_logprobs, and `repetition_penalty`): the cost of
asking, measured against the same load without them. --structured-share F puts that share
of the requests under a JSON schema (`response_format`, BENCH_SCHEMA: a list of at least 300
records, so no request can finish before its max_tokens and the lengths stay the workload's;
those requests drop ignore_eos, which a grammar refuses): the cost of the masks. Figures and
their definitions: report.py; plots: plots.py.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shlex
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import orjson

# run from anywhere: a server started here comes from tests/server.py, beside tools/
REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from tools.benchmarks.baselines import hf_baseline  # noqa: E402
from tools.benchmarks.bursts import add_flags as add_burst_flags  # noqa: E402
from tools.benchmarks.load import INF, Extras, ProgressLine, run_load  # noqa: E402
from tools.benchmarks.multi_turn import add_flags as add_multi_turn_flags  # noqa: E402
from tools.benchmarks.peers import add_flags as add_compare_flags  # noqa: E402
from tools.benchmarks.report import Slo, per_request, print_report, summarize  # noqa: E402
from tools.benchmarks.workload import Workload, load_jsonl, make_workload  # noqa: E402


async def _served_model(url: str, model: str) -> str:
    if model:
        return model
    async with httpx.AsyncClient(base_url=url) as c:
        return (await c.get("/v1/models")).json()["data"][0]["id"]


def run_rates(url: str, args: argparse.Namespace, wl: Workload, slo: Slo) -> list[dict[str, Any]]:
    """One load per rate (the sweep, or just --rate), each summarised with its raw timings."""
    model = asyncio.run(_served_model(url, args.model))
    rates = [float(r) for r in args.sweep_rates.split(",")] if args.sweep_rates else [args.rate]
    runs = []
    for rate in rates:
        label = f"rate {rate:g}/s " if len(rates) > 1 else ""
        progress = ProgressLine(len(wl.prompts), label, not args.no_progress)
        timings, dur, peak = asyncio.run(
            run_load(
                url,
                model,
                wl,
                args.concurrency,
                rate,
                args.seed,
                progress,
                args.client == "lean",
                request_extras(args),
            )
        )
        summary = summarize(timings, dur, peak, wl, slo)
        runs.append(
            {**summary, "rate": rate if rate != INF else "inf", "requests": per_request(timings)}
        )
    return runs


# --- the command ---------------------------------------------------------------------------------
def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="tools/bench", description=__doc__.splitlines()[0])
    p.add_argument("--url", default="", help="server to load (default: start shuttle here)")
    p.add_argument("--model", default="", help="model name on the server (default: its first)")
    p.add_argument(
        "--model-dir",
        default="",
        help="the model served: an HF folder (float or int8) or a GGUF file (default: SmolLM2)",
    )
    p.add_argument("--num-prompts", type=int, default=16)
    p.add_argument("--input-len", default="128", help="N or LO:HI prompt tokens")
    p.add_argument("--output-len", default="64", help="N or LO:HI output tokens")
    p.add_argument(
        "--shared-prefix",
        type=int,
        default=0,
        help="tokens of a system prompt every request starts with",
    )
    p.add_argument("--jsonl", default="", help="requests from this file (see workload.py)")
    p.add_argument("--concurrency", type=int, default=0, help="most in flight (0: all)")
    p.add_argument("--rate", type=float, default=INF, help="Poisson arrivals per s")
    p.add_argument("--sweep-rates", default="", help="comma list of rates: one run each")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--slo-ttft-ms", type=float, default=0.0, help="goodput: TTFT objective")
    p.add_argument("--slo-tpot-ms", type=float, default=0.0, help="goodput: TPOT objective")
    p.add_argument("--slo-e2e-ms", type=float, default=0.0, help="goodput: E2E objective")
    p.add_argument("--baseline", default="", help="comma list: hf-sequential,hf-static")
    p.add_argument("--hf-batch-size", type=int, default=16)
    p.add_argument(
        "--hf-sequential-subset",
        type=int,
        default=0,
        help="run hf-sequential on this many requests only (0: all)",
    )
    p.add_argument("--dtype", default="float32")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: all cores)")
    p.add_argument("--server-flags", default="", help="flags for the shuttle server started here")
    p.add_argument("--json", default="", help="write the results here")
    p.add_argument("--plot-dir", default="", help="write PNG plots here")
    p.add_argument("--no-progress", action="store_true", help="no progress line on stderr")
    p.add_argument(
        "--client",
        default="lean",
        choices=["lean", "httpx"],
        help="HTTP client of the load (lean: tools/benchmarks/client.py, http:// only)",
    )
    p.add_argument("--admin-token", default="", help="read shuttle's /admin/stats after the run")
    p.add_argument(
        "--logprobs",
        type=int,
        default=None,
        help="every request asks for its tokens' logprobs with this many top ones (0..20)",
    )
    p.add_argument(
        "--repetition-penalty",
        type=float,
        default=None,
        help="every request asks for this repetition_penalty (> 0; 1 is off)",
    )
    p.add_argument(
        "--structured-share",
        type=float,
        default=0.0,
        help="this share of the requests (0..1) asks for JSON under BENCH_SCHEMA",
    )
    add_compare_flags(p)
    add_multi_turn_flags(p)
    add_burst_flags(p)
    args = p.parse_args(argv)
    if not 0.0 <= args.structured_share <= 1.0:
        p.error(f"--structured-share: must be 0..1, got {args.structured_share}")
    if args.logprobs is not None and not 0 <= args.logprobs <= 20:
        p.error(f"--logprobs: must be 0..20, got {args.logprobs}")
    if args.repetition_penalty is not None and not args.repetition_penalty > 0:
        p.error(f"--repetition-penalty: must be > 0, got {args.repetition_penalty}")
    return args


# records that never end in time: at least 300 of them, a token or more each, outlast any
# output length of the workloads, so a constrained request runs to its max_tokens
BENCH_SCHEMA: dict[str, Any] = {
    "type": "array",
    "minItems": 300,
    "items": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 12},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "role": {"enum": ["admin", "user", "guest"]},
        },
        "required": ["name", "age", "role"],
        "additionalProperties": False,
    },
}


def request_extras(args: argparse.Namespace) -> Extras:
    """The body fields requests add: what --logprobs and --repetition-penalty ask of every
    one, and --structured-share's JSON schema of that share."""
    every: dict[str, Any] = {}
    if args.logprobs is not None:
        every["logprobs"] = args.logprobs  # /v1/completions: top logprobs per token
    if args.repetition_penalty is not None:
        every["repetition_penalty"] = args.repetition_penalty
    schema = {"type": "json_schema", "json_schema": {"name": "bench", "schema": BENCH_SCHEMA}}
    chosen = {"ignore_eos": False, "response_format": schema}
    return Extras(every, chosen, args.structured_share)


def _workload(args: argparse.Namespace, model_dir: str) -> tuple[Workload, str]:
    from common.model_paths import hf_config_of

    if args.jsonl:
        return load_jsonl(
            args.jsonl, args.output_len, args.seed, args.num_prompts
        ), f"jsonl {args.jsonl}"
    vocab = hf_config_of(model_dir)["vocab_size"]
    wl = make_workload(
        args.num_prompts, args.input_len, args.output_len, vocab, args.seed, args.shared_prefix
    )
    return wl, f"random, shared prefix {args.shared_prefix}" if args.shared_prefix else "random"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    threads = args.threads or os.cpu_count() or 1
    from common.prepare_model import prepare_default_model

    model_dir = args.model_dir or str(prepare_default_model())
    wl, source = _workload(args, model_dir)
    slo = Slo(args.slo_ttft_ms / 1e3, args.slo_tpot_ms / 1e3, args.slo_e2e_ms / 1e3)
    # KV room for 64 requests of 768 tokens in fp32 (tests/server.py's default is 0.5 GiB)
    flags = [
        "--kv-cache-memory",
        "3",
        "--dtype",
        args.dtype,
        "--num-threads",
        str(threads),
        *shlex.split(args.server_flags),
    ]
    if args.compare:
        return _compare(args, model_dir, flags, threads)
    if args.workload == "multi-turn":
        return _multi_turn(args, model_dir, flags)
    if args.workload == "bursts":
        return _bursts(args, model_dir, flags)
    if args.url:
        runs = run_rates(args.url, args, wl, slo)
        server_stats = _server_stats(args.url, args.admin_token)
    else:
        from tests.server import running_server

        token = args.admin_token or "bench"
        with running_server("--model", model_dir, "--admin-token", token, *flags) as server:
            runs = run_rates(server.url, args, wl, slo)
            server_stats = _server_stats(server.url, token)
    desc = wl.describe()
    result = {
        "workload": {
            "num_prompts": len(wl.prompts),
            "source": source,
            "input_len": "file" if args.jsonl else args.input_len,
            "output_len": args.output_len,
            "prompt_tokens": desc["prompt_tokens"],
            "output_tokens": desc["output_tokens"],
            "concurrency": args.concurrency,
            "shared_prefix": args.shared_prefix,
            "rate": runs[-1]["rate"],
            "sweep_rates": args.sweep_rates,
            "dtype": args.dtype,
            "threads": threads,
            "request_extras": request_extras(args).every,
            "structured_share": args.structured_share,
            "batch_policy": _flag(flags, "--batch-policy", "continuous")
            if not args.url
            else "external",
            "server_flags": " ".join(flags) if not args.url else "external",
            "slo": {
                "ttft_ms": args.slo_ttft_ms,
                "tpot_ms": args.slo_tpot_ms,
                "e2e_ms": args.slo_e2e_ms,
            },
        },
        "shuttle": runs[-1],
        "sweep": runs if len(runs) > 1 else [],
        "server_stats": server_stats,
        "baselines": [
            hf_baseline(
                b,
                model_dir,
                wl,
                args.hf_batch_size,
                args.dtype,
                threads,
                args.hf_sequential_subset if b == "hf-sequential" else 0,
            )
            for b in filter(None, args.baseline.split(","))
        ],
    }
    print_report(result)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_bytes(orjson.dumps(result, option=orjson.OPT_INDENT_2))
    if args.plot_dir:
        from tools.benchmarks.plots import plot_result

        for path in plot_result(result, args.plot_dir):
            print(f"plot: {path}")
    return 0 if all(r["failed"] == 0 for r in runs) else 1


def _compare(args: argparse.Namespace, model_dir: str, flags: list[str], threads: int) -> int:
    """--compare: every server on the fixed workloads of peers.py, one table."""
    from tools.benchmarks.peers import compare, table

    result = compare(args, model_dir, flags, threads)
    print(table(result))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_bytes(orjson.dumps(result, option=orjson.OPT_INDENT_2))
    failed = [
        (name, load)
        for name, s in result["servers"].items()
        for load, summary in s.items()
        if isinstance(summary, dict) and summary.get("failed")
    ]
    return 1 if failed else 0


def _multi_turn(args: argparse.Namespace, model_dir: str, flags: list[str]) -> int:
    """--workload multi-turn: the conversations against one server (multi_turn.py)."""
    from tools.benchmarks.multi_turn import print_summary, run, spec_from_args

    spec = spec_from_args(args)
    return _one_server(
        args,
        model_dir,
        flags,
        lambda url, model, token: run(url, model, spec, args.concurrency, token),
        print_summary,
    )


def _bursts(args: argparse.Namespace, model_dir: str, flags: list[str]) -> int:
    """--workload bursts: steady streams under prompt bursts against one server (bursts.py)."""
    from common.model_paths import hf_config_of
    from tools.benchmarks.bursts import print_summary, run, spec_from_args

    spec, vocab = spec_from_args(args), hf_config_of(model_dir)["vocab_size"]
    return _one_server(
        args,
        model_dir,
        flags,
        lambda url, model, token: run(url, model, spec, vocab, token),
        print_summary,
    )


def _one_server(
    args: argparse.Namespace,
    model_dir: str,
    flags: list[str],
    run: Callable[[str, str, str], dict[str, Any]],
    print_summary: Callable[[dict[str, Any]], None],
) -> int:
    """A workload of its own (`run(url, model, admin token)`) against --url, or a shuttle
    started here with `flags`; its summary printed and written to --json."""
    if args.url:
        model = asyncio.run(_served_model(args.url, args.model))
        result = run(args.url, model, args.admin_token)
    else:
        from tests.server import running_server

        token = args.admin_token or "bench"
        with running_server("--model", model_dir, "--admin-token", token, *flags) as server:
            result = run(server.url, server.model, token)
    result["server_flags"] = " ".join(flags) if not args.url else "external"
    print_summary(result)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_bytes(orjson.dumps(result, option=orjson.OPT_INDENT_2))
    return 0 if result["failed"] == 0 else 1


def _flag(flags: list[str], name: str, default: str) -> str:
    """The last value given to `name` in a flag list."""
    values = [flags[i + 1] for i, f in enumerate(flags[:-1]) if f == name]
    return values[-1] if values else default


def _server_stats(url: str, token: str) -> dict[str, Any]:
    """The scheduler's counters after the run (shuttle only; {} elsewhere)."""
    if not token:
        return {}
    try:
        r = httpx.get(url + "/admin/stats", headers={"Authorization": f"Bearer {token}"})
        stats = r.json() if r.status_code == 200 else {}
    except httpx.HTTPError:
        return {}
    stats.pop("model", None)
    stats.pop("request_ids", None)
    return stats


if __name__ == "__main__":
    sys.exit(main())
