"""tools/bench --workload bursts: steady decode streams while bursts of long prompts arrive.

    tools/bench --workload bursts --streams 8 --burst-size 2 --input-len 1024:2048 \\
        --bursts 4 --quiet-s 10 --server-flags "--num-threads 2"
    tools/bench --workload bursts --server-flags "--prefill-replicas 1 --decode-replicas 1"

S streams (--streams) decode without end: each sends a short random prompt
(--stream-input-len) with `ignore_eos` and a max_tokens that outlasts the run, and sends the
next one when a request ends. Once every stream has its first token, a quiet window
(--quiet-s) measures their inter-token gaps with nothing else arriving. Then come --bursts
bursts, one after another: --burst-size prompts of --input-len random tokens at once, each
asking --burst-output-len tokens; a burst's TTFTs are recorded and the next burst starts
--burst-gap-s after it ends. A gap belongs to the phase in which its later token arrived.
The streams are then closed (a closed stream is cancelled by the server).

The figures: the streams' ITL p50/p99 in the quiet window and under the bursts, the ratio of
the latter's p99 to the former's p50 (how much a prompt burst stalls running streams), and
the bursts' TTFT. The streams' contexts grow as they decode (and each step's attention
with them), so the quiet window, before the bursts, sees shorter ones than the bursts do:
a control run follows on the same server (unless --no-control), the same streams and
phases with no burst sent, and the bursts' p99 is compared with its p50 over the same phase
as well. Co-located prefill stalls decode for each prefill chunk; a prefill/decode
split keeps the streams' gaps flat (docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import random
import time
from typing import Any

import orjson

from tools.benchmarks.client import HttpError, SseConnection
from tools.benchmarks.multi_turn import admin_stats
from tools.benchmarks.report import percentiles
from tools.benchmarks.workload import parse_range


@dataclasses.dataclass(frozen=True)
class BurstSpec:
    streams: int = 8
    stream_input_len: int = 64
    stream_output_len: int = 4000  # each stream request's max_tokens (the next follows)
    quiet_s: float = 10.0
    bursts: int = 4
    burst_size: int = 2
    burst_input_len: tuple[int, int] = (1024, 2048)
    burst_output_len: int = 4
    burst_gap_s: float = 2.0
    seed: int = 0
    control: bool = True  # then the same run without bursts (its gaps over the same phase)

    def __post_init__(self) -> None:
        if self.streams < 1 or self.bursts < 0 or self.burst_size < 1:
            raise ValueError("--streams and --burst-size must be >= 1, --bursts >= 0")
        if self.quiet_s <= 0 or self.burst_gap_s < 0:
            raise ValueError("--quiet-s must be > 0 and --burst-gap-s >= 0")
        if self.stream_output_len < 2 or self.burst_output_len < 1:
            raise ValueError("--output-len must be >= 2 for streams, >= 1 for bursts")


@dataclasses.dataclass
class _Clock:
    """Which phase the run is in: a gap is counted in the phase its later token ends."""

    phase: str = "warmup"
    gaps: dict[str, list[float]] = dataclasses.field(
        default_factory=lambda: {"warmup": [], "quiet": [], "bursts": [], "after": []}
    )


def _prompt(rng: random.Random, n: int, vocab: int) -> list[int]:
    # ids from the middle of the vocabulary, as workload.py's random prompts
    return [rng.randrange(1000, vocab - 1000) for _ in range(n)]


def _body(model: str, prompt: list[int], max_tokens: int) -> bytes:
    return orjson.dumps(
        {
            "model": model,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0.0,
            "ignore_eos": True,
            "stream": True,
        }
    )


async def _stream(
    sent: list[int],
    url: str,
    model: str,
    spec: BurstSpec,
    vocab: int,
    index: int,
    clock: _Clock,
    first: asyncio.Event,
    stop: asyncio.Event,
    errors: list[str],
) -> None:
    """One steady stream: request after request until `stop`; every gap between two tokens
    of one request goes to the clock's current phase."""
    rng = random.Random(f"{spec.seed}:stream:{index}")
    conn = SseConnection(url)
    try:
        while not stop.is_set():
            prompt = _prompt(rng, spec.stream_input_len, vocab)
            sent.append(len(prompt))
            body = _body(model, prompt, spec.stream_output_len)
            last = 0.0
            async for data in conn.stream("/v1/completions", body):
                if data == b"[DONE]":
                    break
                chunk = orjson.loads(data)
                if "error" in chunk:
                    errors.append(str(chunk["error"].get("message", ""))[:200])
                    break
                now = time.perf_counter()
                if last:
                    clock.gaps[clock.phase].append(now - last)
                last = now
                first.set()
                if stop.is_set():
                    break
    except HttpError as e:
        errors.append(str(e))
    finally:
        await conn.close()  # mid-body: the server sees the client leave and cancels


async def _burst_request(
    url: str, model: str, prompt: list[int], max_tokens: int
) -> tuple[float, str]:
    """One burst prompt: its TTFT, or an error."""
    conn, start, ttft = SseConnection(url), time.perf_counter(), 0.0
    try:
        async for data in conn.stream("/v1/completions", _body(model, prompt, max_tokens)):
            if data == b"[DONE]":
                continue
            chunk = orjson.loads(data)
            if "error" in chunk:
                return 0.0, str(chunk["error"].get("message", ""))[:200]
            if not ttft:
                ttft = time.perf_counter() - start
    except HttpError as e:
        return 0.0, str(e)
    finally:
        await conn.close()
    return ttft, ""


async def run_bursts(
    url: str, model: str, spec: BurstSpec, vocab: int, hold_s: float | None = None
) -> dict[str, Any]:
    """One run; with `hold_s`, the control run: the same streams and quiet window, then
    `hold_s` of the bursts' phase with no burst sent (the streams' gaps at the contexts
    they reach in the run with bursts)."""
    clock, stop = _Clock(), asyncio.Event()
    errors: list[str] = []
    sent: list[int] = []  # every prompt's length, streams' and bursts'
    firsts = [asyncio.Event() for _ in range(spec.streams)]
    tasks = [
        asyncio.create_task(
            _stream(sent, url, model, spec, vocab, i, clock, firsts[i], stop, errors)
        )
        for i in range(spec.streams)
    ]
    rng = random.Random(f"{spec.seed}:bursts")
    ttfts: list[float] = []
    burst_tokens = 0
    try:
        await asyncio.gather(*(f.wait() for f in firsts))
        clock.phase = "quiet"
        await asyncio.sleep(spec.quiet_s)
        clock.phase = "bursts"
        start = time.perf_counter()
        for _ in range(spec.bursts if hold_s is None else 0):
            prompts = [
                _prompt(rng, rng.randint(*spec.burst_input_len), vocab)
                for _ in range(spec.burst_size)
            ]
            burst_tokens += sum(map(len, prompts))
            sent += map(len, prompts)
            results = await asyncio.gather(
                *(_burst_request(url, model, p, spec.burst_output_len) for p in prompts)
            )
            ttfts += [t for t, e in results if not e]
            errors += [e for _, e in results if e]
            await asyncio.sleep(spec.burst_gap_s)
        if hold_s is not None:
            await asyncio.sleep(hold_s)
        burst_s = time.perf_counter() - start
        clock.phase = "after"
    finally:
        stop.set()
        await asyncio.gather(*tasks, return_exceptions=True)
    quiet, under = percentiles(clock.gaps["quiet"]), percentiles(clock.gaps["bursts"])
    return {
        "spec": dataclasses.asdict(spec),
        "errors": errors[:5],
        "failed": len(errors),
        "quiet_gaps": len(clock.gaps["quiet"]),
        "burst_gaps": len(clock.gaps["bursts"]),
        "itl_quiet_s": quiet,
        "itl_bursts_s": under,
        "p99_bursts_over_p50_quiet": under["p99"] / quiet["median"] if quiet["median"] else 0.0,
        "burst_ttft_s": percentiles(ttfts),
        "burst_prompt_tokens": burst_tokens,
        "burst_phase_s": burst_s,
        "prompt_tokens_sent": sum(sent),
    }


def print_summary(s: dict[str, Any]) -> None:
    spec = s["spec"]
    print(
        f"bursts: {spec['streams']} streams; {spec['bursts']} bursts of {spec['burst_size']} "
        f"prompts of {spec['burst_input_len'][0]}-{spec['burst_input_len'][1]} tokens "
        f"({s['burst_prompt_tokens']} in all, {s['burst_phase_s']:.1f} s); {s['failed']} failed"
    )
    for key, label in (("itl_quiet_s", "ITL quiet "), ("itl_bursts_s", "ITL bursts")):
        p = s[key]
        print(
            f"  {label} ms  p50 {p['median'] * 1e3:8.1f}  p90 {p['p90'] * 1e3:8.1f}  "
            f"p99 {p['p99'] * 1e3:8.1f}  mean {p['mean'] * 1e3:8.1f}"
        )
    print(f"  ITL p99 under bursts / p50 quiet: {s['p99_bursts_over_p50_quiet']:.2f}x")
    if "itl_control_s" in s:
        p = s["itl_control_s"]
        print(
            f"  ITL control (same phase, no bursts) ms  p50 {p['median'] * 1e3:8.1f}  "
            f"p99 {p['p99'] * 1e3:8.1f}; p99 under bursts / control p50: "
            f"{s['p99_bursts_over_p50_control']:.2f}x"
        )
    p = s["burst_ttft_s"]
    print(f"  burst TTFT ms  p50 {p['median'] * 1e3:8.1f}  p99 {p['p99'] * 1e3:8.1f}")
    h = s.get("handover") or {}
    if h:
        print(
            f"  hand-overs: {h.get('num_handed_over', 0)} sequences, "
            f"{h.get('bytes_sent', 0) / 2**20:.1f} MiB, {h['tokens_moved']} tokens moved; "
            f"transfer {h['transfer_ms_per_1k_tokens']:.1f} ms per 1k tokens against prefill "
            f"{h['prefill_ms_per_1k_prompt_tokens']:.1f} ms per 1k prompt tokens"
        )
    for e in s["errors"]:
        print(f"  error: {e}")


def add_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--streams", type=int, default=8, help="bursts: steady decode streams")
    p.add_argument("--stream-input-len", type=int, default=64, help="bursts: a stream's prompt")
    p.add_argument("--quiet-s", type=float, default=10.0, help="bursts: the quiet window")
    p.add_argument("--bursts", type=int, default=4, help="bursts: how many, one after another")
    p.add_argument("--burst-size", type=int, default=2, help="bursts: prompts per burst")
    p.add_argument("--burst-output-len", type=int, default=4, help="bursts: a prompt's tokens")
    p.add_argument("--burst-gap-s", type=float, default=2.0, help="bursts: pause between them")
    p.add_argument(
        "--no-control",
        action="store_true",
        help="bursts: skip the control run (the same streams and phases, no bursts)",
    )


def spec_from_args(args: argparse.Namespace) -> BurstSpec:
    """--input-len is the bursts' prompt length (default here 1024:2048)."""
    input_len = "1024:2048" if args.input_len == "128" else args.input_len
    return BurstSpec(
        streams=args.streams,
        stream_input_len=args.stream_input_len,
        quiet_s=args.quiet_s,
        bursts=args.bursts,
        burst_size=args.burst_size,
        burst_input_len=parse_range(input_len),
        burst_output_len=args.burst_output_len,
        burst_gap_s=args.burst_gap_s,
        seed=args.seed,
        control=not args.no_control,
    )


def handover_figures(
    before: dict[str, Any], after: dict[str, Any], prompt_tokens: int
) -> dict[str, Any]:
    """Prefill/decode replicas: the hand-overs' counters over the run (kv_handover_* of
    /admin/stats), the transfer's time per 1k tokens moved against the prefill's time per
    1k prompt tokens (what recomputing them would cost). Empty for a `both` replica."""
    keys = [k for k in after if k.startswith("kv_handover_")]
    if not keys:
        return {}
    d = {k[len("kv_handover_") :]: after[k] - before.get(k, 0) for k in keys}
    moved = d.get("blocks_received", 0) * int(after.get("block_size") or 16)
    return {
        **d,
        "tokens_moved": moved,
        "transfer_ms_per_1k_tokens": 1e6 * d.get("transfer_s", 0.0) / moved if moved else 0.0,
        "prefill_ms_per_1k_prompt_tokens": (
            1e6 * d.get("prefill_s", 0.0) / prompt_tokens if prompt_tokens else 0.0
        ),
    }


def run(url: str, model: str, spec: BurstSpec, vocab: int, token: str = "") -> dict[str, Any]:
    """The run with bursts, then (spec.control) the control run without them, on the same
    server: the target compares the bursts' ITL p99 with the control's p50 over the same
    phase, where the streams' contexts (which grow as they decode, and attention with them)
    are the same; the quiet window before the bursts has shorter ones."""
    before = admin_stats(url, token)
    result = asyncio.run(run_bursts(url, model, spec, vocab))
    after = admin_stats(url, token)
    result["handover"] = handover_figures(before, after, result["prompt_tokens_sent"])
    if spec.control:
        control = asyncio.run(run_bursts(url, model, spec, vocab, result["burst_phase_s"]))
        result["itl_control_s"] = p50 = control["itl_bursts_s"]
        result["p99_bursts_over_p50_control"] = (
            result["itl_bursts_s"]["p99"] / p50["median"] if p50["median"] else 0.0
        )
        result["failed"] += control["failed"]
        result["errors"] += control["errors"][:5]
    return result
