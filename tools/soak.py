"""tools/soak: streaming load while random server processes are SIGKILLed.

Clients stream completions (greedy and seeded, 8-48 tokens, `ignore_eos`) back to back
while, every `--kill-every` seconds, one process of a kind picked in turn from a shuffled
cycle (worker, scheduler, detokenizer, tokenizer, gateway) is SIGKILLed; the supervisor
restarts it. Of a kind with several processes (the tokenizers, the gateway processes of
--gateway-processes, 2 by default where there are 2 cores) one is picked at random, so
each gateway process is a target. Every request is classified:

- ok: it finished with the tokens it asked for (a stream resumed after a kill included);
- gateway: its connection broke within `GATEWAY_GRACE_S` of a kill of a gateway process
  (the only process whose death may cost a stream: the streams it held, not the other
  gateway processes');
- failed: anything else (an error event, a non-200, a broken stream with no gateway death).

A connection refused (no gateway listening: with the supervisor holding the listening
socket, a connection waits in its queue instead) is not a request: the client
backs off and tries again; the report counts those attempts apart. A new request refused
with a retryable 503 (`Retry-After`) because the engine is restarting (the gateway takes no
new request until the scheduler serves again) is counted as a request, not completed, and
apart from the failures: it never started, and a client retries it.

The verdict: no hang (every client's request ends within its timeout), no `failed`, at least
`--min-completion` of the requests that reached the gateway ok, and the summed resident
memory of the processes within `MAX_MEMORY_GROWTH` of its figure after the warm-up.

    tools/soak --duration 600 --clients 24 --kill-every 20

tests/integration/test_kill_soak.py runs it for a bounded time (marked slow).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import os
import random
import signal
import socket
import sys
import time
from pathlib import Path

import httpx
import orjson

from tests.server import Server, running_server

KINDS = {
    "worker": "gpu_worker",
    "scheduler": "services.scheduler",
    "detokenizer": "services.detokenizer",
    "tokenizer": "services.tokenizer",
    "gateway": "services.gateway",
}
GATEWAY_GRACE_S = 30.0  # a broken connection this long after a gateway kill is the kill's
MAX_MEMORY_GROWTH = 0.25
WORDS = "river stone lamp orange window quiet seven market cloud paper engine garden".split()


@dataclasses.dataclass
class Report:
    ok: int = 0
    gateway: int = 0  # lost with a gateway process that died
    unreachable: int = 0  # connections refused while the gateway restarted (not requests)
    refused: int = 0  # new requests refused with a retryable 503 while the engine restarted
    failures: list[str] = dataclasses.field(default_factory=list)
    kills: list[tuple[float, str]] = dataclasses.field(default_factory=list)
    rss_warm_mib: float = 0.0
    rss_end_mib: float = 0.0

    @property
    def num_requests(self) -> int:
        return self.ok + self.gateway + self.refused + len(self.failures)

    @property
    def completion(self) -> float:
        return self.ok / self.num_requests if self.num_requests else 0.0

    def gateway_died_lately(self) -> bool:
        now = time.monotonic()
        return any(kind == "gateway" and now - t < GATEWAY_GRACE_S for t, kind in self.kills)

    def verdict(self, min_completion: float) -> list[str]:
        """What fails the soak (nothing: it passed)."""
        problems = [f"failed: {f}" for f in self.failures[:10]]
        if self.completion < min_completion:
            problems.append(f"completion {self.completion:.1%} < {min_completion:.0%}")
        if self.rss_warm_mib and self.rss_end_mib > self.rss_warm_mib * (1 + MAX_MEMORY_GROWTH):
            problems.append(f"memory {self.rss_warm_mib:.0f} -> {self.rss_end_mib:.0f} MiB")
        return problems

    def summary(self) -> str:
        kinds = ", ".join(kind for _, kind in self.kills)
        return (
            f"{self.num_requests} requests: {self.ok} ok ({self.completion:.1%}), "
            f"{self.gateway} lost with a gateway, {self.refused} refused at admission with a "
            f"retryable 503 while the engine restarted, {len(self.failures)} failed "
            f"({self.unreachable} connection attempts refused while a gateway restarted); "
            f"{len(self.kills)} kills ({kinds}); resident memory {self.rss_warm_mib:.0f} MiB "
            f"after the warm-up, {self.rss_end_mib:.0f} MiB at the end"
        )


async def _one(
    client: httpx.AsyncClient, server: Server, rng: random.Random, report: Report
) -> None:
    max_tokens = rng.randint(8, 48)
    body: dict[str, object] = {
        "model": server.model,
        "prompt": " ".join(rng.choices(WORDS, k=rng.randint(3, 30))),
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
        "temperature": 0.0,
    }
    if rng.random() < 0.3:
        body.update(temperature=0.8, seed=rng.randrange(1 << 30))
    tokens, finish = 0, None
    try:
        async with client.stream("POST", "/v1/completions", json=body) as r:
            if r.status_code == 503 and r.headers.get("retry-after"):
                report.refused += 1  # new while the engine restarts: not started, retry
                await asyncio.sleep(0.2)
                return
            if r.status_code != 200:
                report.failures.append(f"HTTP {r.status_code} {(await r.aread())[:200]!r}")
                return
            async for line in r.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                chunk = orjson.loads(line[6:])
                if "error" in chunk:
                    report.failures.append(f"error event {chunk['error']}")
                    return
                if chunk.get("usage"):
                    tokens = chunk["usage"]["completion_tokens"]
                for choice in chunk.get("choices", []):
                    finish = choice.get("finish_reason") or finish
    except httpx.ConnectError:  # no gateway listening: the request never reached one
        report.unreachable += 1
        await asyncio.sleep(0.2)  # (a client's back-off while the gateway restarts)
        return
    except httpx.TransportError as e:
        if report.gateway_died_lately():
            report.gateway += 1
        else:
            report.failures.append(f"connection: {e!r}")
        return
    if finish == "length" and tokens == max_tokens:
        report.ok += 1
    else:
        report.failures.append(f"finish {finish} after {tokens} of {max_tokens} tokens")


def _rss_mib(server: Server) -> float:
    total = 0.0
    for _, pid in [("supervisor", server.proc.pid), *server.children()]:
        try:
            status = Path(f"/proc/{pid}/status").read_text()
        except OSError:
            continue  # (restarting)
        line = next(line for line in status.splitlines() if line.startswith("VmRSS:"))
        total += int(line.split()[1]) / 1024
    return total


async def _kill_loop(
    server: Server, until: float, every_s: float, report: Report, seed: int
) -> None:
    rng = random.Random(seed)
    cycle: list[str] = []
    while time.monotonic() + every_s < until:
        await asyncio.sleep(every_s * rng.uniform(0.75, 1.25))  # the load's own pace
        if not cycle:
            cycle = rng.sample(sorted(KINDS), len(KINDS))
        kind = cycle.pop()
        pids = [pid for module, pid in server.children() if module == KINDS[kind]]
        if pids:
            report.kills.append((time.monotonic(), kind))
            os.kill(rng.choice(pids), signal.SIGKILL)


async def soak(
    server: Server,
    duration_s: float,
    clients: int = 24,
    kill_every_s: float = 20.0,
    seed: int = 0,
    request_timeout_s: float = 180.0,
) -> Report:
    """Run the load and the kills for `duration_s`; the report (requests still in flight at
    the end finish first; a hang shows as a request timeout, a failure)."""
    report = Report()
    start = time.monotonic()
    until = start + duration_s

    async def client_loop(i: int) -> None:
        rng = random.Random(seed * 1000 + i)
        async with httpx.AsyncClient(base_url=server.url, timeout=request_timeout_s) as client:
            while time.monotonic() < until:
                try:  # (SSE keep-alives would keep a read timeout from firing)
                    await asyncio.wait_for(_one(client, server, rng, report), request_timeout_s)
                except TimeoutError:
                    report.failures.append(f"hang: no end within {request_timeout_s:g} s")

    async def measure_warm() -> None:
        await asyncio.sleep(min(kill_every_s / 2, duration_s / 4))  # before the first kill
        report.rss_warm_mib = _rss_mib(server)

    await asyncio.gather(
        *(client_loop(i) for i in range(clients)),
        _kill_loop(server, until, kill_every_s, report, seed),
        measure_warm(),
    )
    report.rss_end_mib = _rss_mib(server)
    return report


def server_flags(clients: int) -> list[str]:
    """A fixed port (a free one now), which the supervisor listens on for every gateway
    process it (re)starts."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return ["--port", str(port), "--num-tokenizers", "2", "--max-num-seqs", str(max(clients, 8))]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tools/soak", description=__doc__.split("\n\n")[0])
    parser.add_argument("--duration", type=float, default=600.0, help="seconds of load")
    parser.add_argument("--clients", type=int, default=24, help="concurrent streams")
    parser.add_argument("--kill-every", type=float, default=20.0, help="seconds between kills")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--min-completion", type=float, default=0.8)
    parser.add_argument("flags", nargs="*", help="more `shuttle serve` flags (after --)")
    args = parser.parse_args(argv)
    with running_server(*server_flags(args.clients), *args.flags) as server:
        report = asyncio.run(soak(server, args.duration, args.clients, args.kill_every, args.seed))
    print(report.summary())
    problems = report.verdict(args.min_completion)
    for problem in problems:
        print("FAIL", problem)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
