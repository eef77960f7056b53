"""tools/bench figures: per-request timings, percentiles, goodput under SLOs, the printed report.

Definitions follow `vllm bench serve`: TTFT is the time to the first streamed chunk with
text; TPOT is (E2E - TTFT) / (output tokens - 1) per request; ITL is every gap between two
chunks with text; E2E is the request's whole time. Goodput counts the requests that meet
every SLO given (TTFT, TPOT, E2E), as a fraction of all requests and per second.
"""

from __future__ import annotations

import dataclasses
import statistics
from typing import Any

from tools.benchmarks.workload import Workload


@dataclasses.dataclass
class Timing:
    """One request as the client saw it."""

    ttft: float = 0.0
    e2e: float = 0.0
    itl: list[float] = dataclasses.field(default_factory=list)
    output_tokens: int = 0
    prompt_tokens: int = 0  # from the server's usage (0 when it sent none)
    error: str = ""
    logprob_tokens: int = 0  # output tokens whose logprobs came back (with --logprobs)

    @property
    def tpot(self) -> float:
        return (self.e2e - self.ttft) / (self.output_tokens - 1) if self.output_tokens > 1 else 0.0


@dataclasses.dataclass(frozen=True)
class Slo:
    """Service-level objectives in seconds; 0 = not set."""

    ttft: float = 0.0
    tpot: float = 0.0
    e2e: float = 0.0

    def met(self, t: Timing) -> bool:
        return (
            not t.error
            and (not self.ttft or t.ttft <= self.ttft)
            and (not self.tpot or t.tpot <= self.tpot)
            and (not self.e2e or t.e2e <= self.e2e)
        )

    @property
    def is_set(self) -> bool:
        return bool(self.ttft or self.tpot or self.e2e)


def percentiles(xs: list[float]) -> dict[str, float]:
    if not xs:
        return {"mean": 0.0, "median": 0.0, "p90": 0.0, "p99": 0.0}
    s = sorted(xs)
    at = lambda q: s[min(len(s) - 1, int(q * len(s)))]  # noqa: E731
    return {
        "mean": statistics.fmean(s),
        "median": statistics.median(s),
        "p90": at(0.9),
        "p99": at(0.99),
    }


def summarize(
    timings: list[Timing], duration: float, peak: int, wl: Workload, slo: Slo | None = None
) -> dict[str, Any]:
    ok = [t for t in timings if not t.error]
    out_tokens = sum(t.output_tokens for t in ok)
    prompt_tokens = sum(
        t.prompt_tokens or (0 if isinstance(p, str) else len(p))
        for t, p in zip(timings, wl.prompts, strict=True)
        if not t.error
    )
    summary = {
        "name": "shuttle",
        "completed": len(ok),
        "failed": len(timings) - len(ok),
        "errors": sorted({t.error for t in timings if t.error})[:5],
        "duration_s": duration,
        "peak_concurrency": peak,
        "request_throughput": len(ok) / duration,
        "prompt_tokens": prompt_tokens,
        "output_tokens": out_tokens,
        "logprob_tokens": sum(t.logprob_tokens for t in ok),  # (with --logprobs: all of them)
        "output_tok_s": out_tokens / duration,
        "total_tok_s": (out_tokens + prompt_tokens) / duration,
        "ttft_s": percentiles([t.ttft for t in ok]),
        "tpot_s": percentiles([t.tpot for t in ok if t.output_tokens > 1]),
        "itl_s": percentiles([x for t in ok for x in t.itl]),
        "e2e_s": percentiles([t.e2e for t in ok]),
    }
    if slo is not None and slo.is_set:
        good = sum(slo.met(t) for t in timings)
        summary["goodput"] = {
            "slo_ttft_s": slo.ttft,
            "slo_tpot_s": slo.tpot,
            "slo_e2e_s": slo.e2e,
            "good_requests": good,
            "fraction": good / max(1, len(timings)),
            "request_rate": good / duration,
        }
    return summary


def per_request(timings: list[Timing]) -> list[dict[str, Any]]:
    """The raw figures (for plots made later from the JSON), microsecond precision."""
    r6 = lambda x: round(x, 6)  # noqa: E731
    return [
        {
            "ttft": r6(t.ttft),
            "tpot": r6(t.tpot),
            "e2e": r6(t.e2e),
            "output_tokens": t.output_tokens,
            "prompt_tokens": t.prompt_tokens,
            "itl": [r6(x) for x in t.itl],
            "error": t.error,
        }
        for t in timings
    ]


def timings_from_json(rows: list[dict[str, Any]]) -> list[Timing]:
    return [
        Timing(
            ttft=r["ttft"],
            e2e=r["e2e"],
            itl=r["itl"],
            output_tokens=r["output_tokens"],
            prompt_tokens=r.get("prompt_tokens", 0),
            error=r.get("error", ""),
        )
        for r in rows
    ]


def _line(s: dict[str, Any]) -> str:
    return (
        f"{s['completed']} ok, {s['failed']} failed, {s['duration_s']:.2f} s, "
        f"{s['output_tok_s']:.1f} output tok/s, {s['total_tok_s']:.1f} total tok/s, "
        f"{s['request_throughput']:.2f} req/s, peak concurrency {s['peak_concurrency']}"
    )


def print_report(result: dict[str, Any]) -> None:
    w, s = result["workload"], result["shuttle"]
    print(
        f"workload: {w['num_prompts']} prompts ({w['source']}), input {w['input_len']} "
        f"({w['prompt_tokens']} tokens), output {w['output_len']} ({w['output_tokens']} "
        f"tokens), concurrency {w['concurrency'] or 'all'}, rate {w['rate']}, dtype "
        f"{w['dtype']}, threads {w['threads']}, server flags {w['server_flags']!r}"
    )
    if w.get("request_extras"):
        print(f"every request also asks for {w['request_extras']}")
    if w.get("structured_share"):
        print(f"{w['structured_share']:.0%} of the requests ask for JSON (BENCH_SCHEMA)")
    for run in result.get("sweep", []):
        print(
            f"  rate {run['rate']:>6}: {_line(run)}; TTFT p99 "
            f"{run['ttft_s']['p99'] * 1e3:.1f} ms, TPOT p99 {run['tpot_s']['p99'] * 1e3:.1f} ms"
        )
    print(f"{s['name']}: {_line(s)}")
    for key in ("ttft_s", "tpot_s", "itl_s", "e2e_s"):
        p = s[key]
        print(
            f"  {key[:-2].upper():5} ms  mean {p['mean'] * 1e3:8.1f}  median "
            f"{p['median'] * 1e3:8.1f}  p90 {p['p90'] * 1e3:8.1f}  p99 {p['p99'] * 1e3:8.1f}"
        )
    if "goodput" in s:
        g = s["goodput"]
        print(
            f"  goodput: {g['good_requests']}/{s['completed'] + s['failed']} requests "
            f"({g['fraction']:.1%}) met TTFT<={g['slo_ttft_s'] * 1e3:g} ms, TPOT<="
            f"{g['slo_tpot_s'] * 1e3:g} ms, E2E<={g['slo_e2e_s']:g} s (0 = no SLO): "
            f"{g['request_rate']:.2f} req/s"
        )
    for b in result["baselines"]:
        note = f" (measured on {b['num_requests']} requests)" if b.get("subset") else ""
        print(
            f"{b['name']}: {b['duration_s']:.2f} s{note}, {b['output_tok_s']:.1f} useful "
            f"output tok/s -> shuttle is {s['output_tok_s'] / b['output_tok_s']:.2f}x"
        )
