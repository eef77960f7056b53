"""Hot-swap and cancellation figures, in one run on one server (SmolLM2, fp32):

- swap duration in each mode, and TTFT/TPOT of the requests in flight during the swap
  against the same load without a swap;
- time from cancel to the stream's end (the scheduler frees the blocks before it tells the
  detokenizer, so this bounds cancel -> blocks freed from above), p50/p99 over 200.

    .venv/bin/python -m tools.benchmarks.swap [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from pathlib import Path

import httpx
import orjson

from common.prepare_model import prepare_default_model
from tests.server import running_server

TOKEN = "bench"
ADMIN = {"Authorization": f"Bearer {TOKEN}"}


async def _stream(
    c: httpx.AsyncClient, model: str, i: int, max_tokens: int, rid: str | None = None
) -> dict:
    body = {
        "model": model,
        "prompt": f"Request {i}: write about the sea.",
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
    }
    start = time.perf_counter()
    first = last = 0.0
    n = 0
    finish = ""
    headers = {"X-Request-Id": rid} if rid else {}
    async with c.stream("POST", "/v1/completions", json=body, headers=headers) as r:
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                ch = orjson.loads(line[6:])["choices"][0]
                if ch.get("text"):
                    last = time.perf_counter()
                    first = first or last
                    n += 1
                finish = ch.get("finish_reason") or finish
    return {
        "ttft": first - start,
        "tpot": (last - first) / max(1, n - 1),
        "finish": finish,
        "end": time.perf_counter(),
    }


async def _load(url: str, model: str, swap_body: dict | None) -> dict:
    async with httpx.AsyncClient(base_url=url, timeout=600) as c:
        tasks = [asyncio.create_task(_stream(c, model, i, 48)) for i in range(16)]
        swap = {}
        if swap_body:
            await asyncio.sleep(0.5)
            r = await c.post("/admin/swap-model", json=swap_body, headers=ADMIN)
            swap = r.json()
        outs = await asyncio.gather(*tasks)
    ok = [o for o in outs if o["finish"] == "length"]
    return {
        "failed": len(outs) - len(ok),
        "ttft_p50_ms": statistics.median(o["ttft"] for o in ok) * 1e3,
        "tpot_p50_ms": statistics.median(o["tpot"] for o in ok) * 1e3,
        "swap": swap,
    }


async def _cancels(url: str, model: str) -> dict:
    rng = random.Random(3)
    lat: list[float] = []
    async with httpx.AsyncClient(
        base_url=url, timeout=600, limits=httpx.Limits(max_connections=300)
    ) as c:

        async def cancel(i: int) -> None:
            await asyncio.sleep(rng.uniform(0.5, 4.0))
            t = time.perf_counter()
            task = ends[i]
            await c.post(f"/admin/cancel/b{i}", headers=ADMIN)
            out = await task
            if out["finish"] == "cancelled":
                lat.append(out["end"] - t)

        ends = {i: asyncio.create_task(_stream(c, model, i, 64, rid=f"b{i}")) for i in range(200)}
        await asyncio.gather(*(cancel(i) for i in range(0, 200, 2)))
        await asyncio.gather(*ends.values())
    lat.sort()
    return {
        "n": len(lat),
        "p50_ms": lat[len(lat) // 2] * 1e3,
        "p99_ms": lat[int(len(lat) * 0.99)] * 1e3,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", default="")
    args = p.parse_args(argv)
    model_dir = str(prepare_default_model())
    results: dict = {}
    with running_server("--admin-token", TOKEN, "--max-num-seqs", "64") as s:
        results["baseline"] = asyncio.run(_load(s.url, s.model, None))
        for mode in ("overlap", "drain"):
            body = {"model": model_dir, "version": f"smol-{mode}", "mode": mode}
            results[mode] = asyncio.run(_load(s.url, s.model, body))
        results["cancel_to_stream_end"] = asyncio.run(_cancels(s.url, s.model))
    print(json.dumps(results, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
