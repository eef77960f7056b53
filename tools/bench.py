"""tools/bench: load an OpenAI-compatible server and measure it, beside transformers baselines.

    tools/bench --num-prompts 16 --input-len 128 --output-len 64 --baseline hf-static
    tools/bench --url http://127.0.0.1:8000 --input-len 32:512 --output-len 16:256 --rate 4

Prompts are random token ids (as `vllm bench serve --dataset-name random`), sent to
/v1/completions with `ignore_eos`, streamed, so TTFT and every inter-token gap are seen.
Without --url a shuttle server is started here (and stopped) with --server-flags. Baselines
run afterwards on the same prompts and lengths, in this process, same dtype and threads.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import orjson

REPO = Path(__file__).resolve().parent.parent


@dataclasses.dataclass
class Workload:
    prompts: list[list[int]]
    output_lens: list[int]

    @property
    def num_prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)

    @property
    def num_output_tokens(self) -> int:
        return sum(self.output_lens)


@dataclasses.dataclass
class Timing:
    ttft: float = 0.0
    e2e: float = 0.0
    itl: list[float] = dataclasses.field(default_factory=list)
    output_tokens: int = 0
    error: str = ""

    @property
    def tpot(self) -> float:
        return (self.e2e - self.ttft) / (self.output_tokens - 1) if self.output_tokens > 1 else 0.0


def _range(text: str) -> tuple[int, int]:
    lo, _, hi = text.partition(":")
    return int(lo), int(hi or lo)


def make_workload(n: int, input_len: str, output_len: str, vocab: int, seed: int,
                  shared_prefix: int = 0) -> Workload:
    """Random prompts; with `shared_prefix`, every prompt starts with the same tokens (a
    system prompt), followed by its own random part of `input_len` tokens."""
    rng = random.Random(seed)
    (ilo, ihi), (olo, ohi) = _range(input_len), _range(output_len)
    # ids from the middle of the vocabulary: ordinary word pieces, no special tokens
    word = lambda: rng.randrange(1000, vocab - 1000)  # noqa: E731
    prefix = [word() for _ in range(shared_prefix)]
    prompts = [prefix + [word() for _ in range(rng.randint(ilo, ihi))] for _ in range(n)]
    return Workload(prompts, [rng.randint(olo, ohi) for _ in range(n)])


# --- load generation ---------------------------------------------------------------------------
async def _one(client: httpx.AsyncClient, model: str, prompt: list[int], out_len: int) -> Timing:
    body = {"model": model, "prompt": prompt, "max_tokens": out_len, "temperature": 0.0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    t = Timing()
    start = last = time.perf_counter()
    try:
        async with client.stream("POST", "/v1/completions", json=body) as r:
            if r.status_code != 200:
                t.error = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
                return t
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = orjson.loads(line[6:])
                if chunk.get("usage"):
                    t.output_tokens = chunk["usage"]["completion_tokens"]
                if chunk.get("choices") and chunk["choices"][0].get("text"):
                    now = time.perf_counter()
                    if not t.ttft:
                        t.ttft = now - start
                    else:
                        t.itl.append(now - last)
                    last = now
    except httpx.HTTPError as e:
        t.error = f"{type(e).__name__}: {e}"
    t.e2e = time.perf_counter() - start
    return t


async def run_load(url: str, model: str, wl: Workload, concurrency: int, rate: float,
                   seed: int) -> tuple[list[Timing], float, int]:
    limits = httpx.Limits(max_connections=max(concurrency, len(wl.prompts)) + 4)
    sem = asyncio.Semaphore(concurrency if concurrency > 0 else len(wl.prompts))
    rng = random.Random(seed)
    peak = active = 0

    async def guarded(client: httpx.AsyncClient, i: int) -> Timing:
        nonlocal peak, active
        async with sem:
            active += 1
            peak = max(peak, active)
            try:
                return await _one(client, model, wl.prompts[i], wl.output_lens[i])
            finally:
                active -= 1

    async with httpx.AsyncClient(base_url=url, timeout=3600, limits=limits) as client:
        start = time.perf_counter()
        tasks = []
        for i in range(len(wl.prompts)):
            tasks.append(asyncio.create_task(guarded(client, i)))
            if rate != float("inf"):
                await asyncio.sleep(rng.expovariate(rate))
        timings = list(await asyncio.gather(*tasks))
        return timings, time.perf_counter() - start, peak


# --- baselines: transformers generate -------------------------------------------------------------
def hf_baseline(kind: str, model_dir: str, wl: Workload, batch_size: int, dtype: str,
                threads: int) -> dict[str, Any]:
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(threads)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).eval()
    model.generation_config.eos_token_id = None  # like ignore_eos: every request runs its length
    pad = model.config.pad_token_id if model.config.pad_token_id is not None else 0
    order = list(range(len(wl.prompts)))
    groups = [[i] for i in order] if kind == "hf-sequential" else [
        order[i:i + batch_size] for i in range(0, len(order), batch_size)]
    start = time.perf_counter()
    computed = 0
    with torch.inference_mode():
        for g in groups:
            width = max(len(wl.prompts[i]) for i in g)
            ids = torch.full((len(g), width), pad, dtype=torch.long)
            mask = torch.zeros((len(g), width), dtype=torch.long)
            for row, i in enumerate(g):  # left padding, as generate wants for decoder-only
                ids[row, width - len(wl.prompts[i]):] = torch.tensor(wl.prompts[i])
                mask[row, width - len(wl.prompts[i]):] = 1
            new = max(wl.output_lens[i] for i in g)
            model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new,
                           min_new_tokens=new, do_sample=False, pad_token_id=pad)
            computed += len(g) * new
    dur = time.perf_counter() - start
    return {"name": kind, "duration_s": dur, "output_tok_s": wl.num_output_tokens / dur,
            "computed_output_tokens": computed, "batch_size": 1 if kind == "hf-sequential"
            else batch_size}


# --- reporting -----------------------------------------------------------------------------------
def _pct(xs: list[float]) -> dict[str, float]:
    if not xs:
        return {"mean": 0.0, "median": 0.0, "p90": 0.0, "p99": 0.0}
    s = sorted(xs)
    at = lambda q: s[min(len(s) - 1, int(q * len(s)))]  # noqa: E731
    return {"mean": statistics.fmean(s), "median": statistics.median(s), "p90": at(0.9),
            "p99": at(0.99)}


def summarize(timings: list[Timing], duration: float, peak: int, wl: Workload) -> dict[str, Any]:
    ok = [t for t in timings if not t.error]
    out_tokens = sum(t.output_tokens for t in ok)
    return {
        "name": "shuttle",
        "completed": len(ok), "failed": len(timings) - len(ok),
        "errors": sorted({t.error for t in timings if t.error})[:5],
        "duration_s": duration, "peak_concurrency": peak,
        "request_throughput": len(ok) / duration,
        "output_tok_s": out_tokens / duration,
        "total_tok_s": (out_tokens + sum(len(wl.prompts[i]) for i, t in enumerate(timings)
                                         if not t.error)) / duration,
        "ttft_s": _pct([t.ttft for t in ok]),
        "tpot_s": _pct([t.tpot for t in ok if t.output_tokens > 1]),
        "itl_s": _pct([x for t in ok for x in t.itl]),
        "e2e_s": _pct([t.e2e for t in ok]),
    }


def print_report(result: dict[str, Any]) -> None:
    w, s = result["workload"], result["shuttle"]
    print(f"workload: {w['num_prompts']} prompts, input {w['input_len']} ({w['prompt_tokens']} "
          f"tokens), output {w['output_len']} ({w['output_tokens']} tokens), concurrency "
          f"{w['concurrency'] or 'all'}, rate {w['rate']}, dtype {w['dtype']}, threads "
          f"{w['threads']}, server flags {w['server_flags']!r}")
    print(f"shuttle: {s['completed']} ok, {s['failed']} failed, {s['duration_s']:.2f} s, "
          f"{s['output_tok_s']:.1f} output tok/s, {s['request_throughput']:.2f} req/s, peak "
          f"concurrency {s['peak_concurrency']}")
    for key in ("ttft_s", "tpot_s", "itl_s", "e2e_s"):
        p = s[key]
        print(f"  {key[:-2].upper():5} ms  mean {p['mean'] * 1e3:8.1f}  median "
              f"{p['median'] * 1e3:8.1f}  p90 {p['p90'] * 1e3:8.1f}  p99 {p['p99'] * 1e3:8.1f}")
    for b in result["baselines"]:
        print(f"{b['name']}: {b['duration_s']:.2f} s, {b['output_tok_s']:.1f} useful output "
              f"tok/s -> shuttle is {s['output_tok_s'] / b['output_tok_s']:.2f}x")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="tools/bench", description=__doc__.splitlines()[0])
    p.add_argument("--url", default="", help="server to load (default: start shuttle here)")
    p.add_argument("--model", default="", help="model name on the server (default: its first)")
    p.add_argument("--model-dir", default="", help="HF folder for baselines (default: SmolLM2)")
    p.add_argument("--num-prompts", type=int, default=16)
    p.add_argument("--input-len", default="128", help="N or LO:HI prompt tokens")
    p.add_argument("--output-len", default="64", help="N or LO:HI output tokens")
    p.add_argument("--shared-prefix", type=int, default=0,
                   help="tokens of a system prompt every request starts with")
    p.add_argument("--concurrency", type=int, default=0, help="most in flight (0: all)")
    p.add_argument("--rate", type=float, default=float("inf"), help="Poisson arrivals per s")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--baseline", default="", help="comma list: hf-sequential,hf-static")
    p.add_argument("--hf-batch-size", type=int, default=16)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: all cores)")
    p.add_argument("--server-flags", default="", help="flags for the shuttle server started here")
    p.add_argument("--json", default="", help="write the results here")
    p.add_argument("--admin-token", default="", help="read shuttle's /admin/stats after the run")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    import os
    import shlex

    sys.path.insert(0, str(REPO))
    args = parse_args(argv)
    threads = args.threads or os.cpu_count() or 1
    from gpu_worker.prepare_model import prepare_default_model

    model_dir = args.model_dir or str(prepare_default_model())
    vocab = json.loads((Path(model_dir) / "config.json").read_text())["vocab_size"]
    wl = make_workload(args.num_prompts, args.input_len, args.output_len, vocab, args.seed,
                       args.shared_prefix)
    flags = ["--dtype", args.dtype, "--num-threads", str(threads), *shlex.split(args.server_flags)]
    server_stats: dict[str, Any] = {}
    if args.url:
        timings, dur, peak = asyncio.run(_load(args.url, args, wl))
        server_stats = _server_stats(args.url, args.admin_token)
    else:
        from tests.server import running_server

        token = args.admin_token or "bench"
        with running_server("--model", model_dir, "--admin-token", token, *flags) as server:
            timings, dur, peak = asyncio.run(_load(server.url, args, wl))
            server_stats = _server_stats(server.url, token)
    result = {
        "workload": {"num_prompts": args.num_prompts, "input_len": args.input_len,
                     "output_len": args.output_len, "prompt_tokens": wl.num_prompt_tokens,
                     "output_tokens": wl.num_output_tokens, "concurrency": args.concurrency,
                     "shared_prefix": args.shared_prefix,
                     "rate": args.rate, "dtype": args.dtype, "threads": threads,
                     "server_flags": " ".join(flags) if not args.url else "external"},
        "shuttle": summarize(timings, dur, peak, wl),
        "server_stats": server_stats,
        "baselines": [hf_baseline(b, model_dir, wl, args.hf_batch_size, args.dtype, threads)
                      for b in filter(None, args.baseline.split(","))],
    }
    print_report(result)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    return 0 if result["shuttle"]["failed"] == 0 else 1


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


async def _load(url: str, args: argparse.Namespace, wl: Workload) -> tuple[list[Timing], float, int]:
    model = args.model
    if not model:
        async with httpx.AsyncClient(base_url=url) as c:
            model = (await c.get("/v1/models")).json()["data"][0]["id"]
    return await run_load(url, model, wl, args.concurrency, args.rate, args.seed)


if __name__ == "__main__":
    sys.exit(main())
