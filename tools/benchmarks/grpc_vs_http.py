"""The same load over gRPC (Generate) and HTTP/SSE (/v1/completions), on one server in one
run, to compare the two front ends.

    .venv/bin/python -m tools.benchmarks.grpc_vs_http --num-prompts 16 --output-len 64
    .venv/bin/python -m tools.benchmarks.grpc_vs_http --url http://H:P --grpc H:P2 --rounds 3

Prompts are random token ids (workload.py), greedy, `ignore_eos`, all sent at once. Rounds
alternate which protocol goes first, so neither always meets a warmer server. TTFT and
inter-token gaps are taken at the first and each later message carrying text, as tools/bench
does for SSE; output tokens come from the final usage.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shlex
import sys
import time
from pathlib import Path
from typing import Any

import grpc

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from proto import shuttle_pb2 as pb  # noqa: E402
from proto import shuttle_pb2_grpc as pb_grpc  # noqa: E402
from tools.benchmarks.load import run_load  # noqa: E402
from tools.benchmarks.report import Timing, summarize  # noqa: E402
from tools.benchmarks.workload import Prompt, Workload, make_workload  # noqa: E402


async def _one_grpc(stub: pb_grpc.ShuttleStub, prompt: Prompt, out_len: int) -> Timing:
    request = pb.GenerateRequest(max_tokens=out_len, temperature=0.0, ignore_eos=True)
    if isinstance(prompt, str):
        request.text = prompt
    else:
        request.token_ids.CopyFrom(pb.TokenIds(ids=prompt))
    t = Timing()
    start = last = time.perf_counter()
    try:
        async for r in stub.Generate(request, timeout=3600):
            if r.text:
                now = time.perf_counter()
                if not t.ttft:
                    t.ttft = now - start
                else:
                    t.itl.append(now - last)
                last = now
            if r.finish_reason:
                t.output_tokens = r.usage.completion_tokens
    except grpc.aio.AioRpcError as e:
        t.error = f"{e.code().name}: {e.details()}"
    t.e2e = time.perf_counter() - start
    return t


async def run_grpc_load(addr: str, wl: Workload) -> tuple[list[Timing], float, int]:
    async with grpc.aio.insecure_channel(addr) as channel:
        stub = pb_grpc.ShuttleStub(channel)
        start = time.perf_counter()
        calls = [_one_grpc(stub, p, n) for p, n in zip(wl.prompts, wl.output_lens, strict=True)]
        timings = list(await asyncio.gather(*calls))
        return timings, time.perf_counter() - start, len(calls)


async def run_rounds(
    url: str, addr: str, model: str, wl: Workload, rounds: int
) -> dict[str, list[dict[str, Any]]]:
    warm = Workload(wl.prompts[:2], [4, 4])
    await run_load(url, model, warm, 0, float("inf"), 0)
    await run_grpc_load(addr, warm)
    results: dict[str, list[dict[str, Any]]] = {"http": [], "grpc": []}
    for i in range(rounds):
        for proto in ("http", "grpc") if i % 2 == 0 else ("grpc", "http"):
            if proto == "http":
                timings, dur, peak = await run_load(url, model, wl, 0, float("inf"), 0)
            else:
                timings, dur, peak = await run_grpc_load(addr, wl)
            results[proto].append(summarize(timings, dur, peak, wl) | {"round": i})
    return results


def report(results: dict[str, list[dict[str, Any]]]) -> None:
    print(
        f"{'':5} {'round':>5} {'ok':>4} {'out tok/s':>10} {'TTFT mean':>10} {'TTFT p50':>9} "
        f"{'TTFT p90':>9} {'ITL mean':>9} {'E2E mean':>9}  (ms)"
    )
    for proto, rows in results.items():
        for s in rows:
            ttft, itl, e2e = s["ttft_s"], s["itl_s"], s["e2e_s"]
            print(
                f"{proto:5} {s['round']:>5} {s['completed']:>4} {s['output_tok_s']:>10.1f} "
                f"{ttft['mean'] * 1e3:>10.1f} {ttft['median'] * 1e3:>9.1f} "
                f"{ttft['p90'] * 1e3:>9.1f} {itl['mean'] * 1e3:>9.1f} "
                f"{e2e['mean'] * 1e3:>9.1f}"
            )


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m tools.benchmarks.grpc_vs_http", description=__doc__.splitlines()[0]
    )
    p.add_argument("--url", default="", help="HTTP server (default: start shuttle here)")
    p.add_argument("--grpc", default="", help="its gRPC HOST:PORT (with --url)")
    p.add_argument("--num-prompts", type=int, default=16)
    p.add_argument("--input-len", default="64", help="N or LO:HI prompt tokens")
    p.add_argument("--output-len", default="64", help="N or LO:HI output tokens")
    p.add_argument("--rounds", type=int, default=2, help="rounds of each protocol")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--server-flags", default="", help="flags for the server started here")
    p.add_argument("--json", default="", help="write the results here")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from common.prepare_model import prepare_default_model

    model_dir = prepare_default_model()
    vocab = json.loads((Path(model_dir) / "config.json").read_text())["vocab_size"]
    wl = make_workload(args.num_prompts, args.input_len, args.output_len, vocab, args.seed)
    if args.url:
        import httpx

        model = httpx.get(args.url + "/v1/models").json()["data"][0]["id"]
        results = asyncio.run(run_rounds(args.url, args.grpc, model, wl, args.rounds))
    else:
        from tests.server import running_server

        flags = ["--grpc-port", "0", *shlex.split(args.server_flags)]
        with running_server(*flags) as server:
            assert server.grpc_addr, "the server announced no gRPC address"
            results = asyncio.run(
                run_rounds(server.url, server.grpc_addr, server.model, wl, args.rounds)
            )
    print(
        f"workload: {args.num_prompts} concurrent requests, {wl.num_prompt_tokens} prompt "
        f"tokens, {wl.num_output_tokens} output tokens, greedy, ignore_eos; "
        f"server flags {args.server_flags!r}"
    )
    report(results)
    if args.json:
        Path(args.json).write_text(json.dumps({"workload": vars(args), **results}, indent=2))
    failed = sum(s["failed"] for rows in results.values() for s in rows)
    return 0 if failed == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
