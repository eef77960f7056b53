"""tools/bench --workload multi-turn: chat conversations whose prefixes must outlive the others.

    tools/bench --workload multi-turn --conversations 24 --turns 6 --user-len 40:80 \\
        --system-len 48 --output-len 16 --concurrency 2 \\
        --server-flags "--kv-cache-memory 0.09 --kv-offload-memory 1"

C conversations of T turns each. A turn sends the whole conversation so far to
/v1/chat/completions (the system prompt, the previous user messages and the assistant's
actual replies) plus a new user message, greedy, streamed. Turns interleave across the
conversations, round-robin (every other conversation runs between two turns of one) or in a
seeded random order, so a conversation's prefix must survive while the others run: the
prefix cache's test. A conversation's next turn waits for its reply; at most --concurrency
turns are in flight.

Text is seeded words (--seed), so two runs send the same first turns and, greedy, the same
conversations. The report: prompt tokens and cached_tokens (usage.prompt_tokens_details),
their ratio the hit rate (and over the turns after the first, where a conversation's own
prefix can hit); the working set, the blocks of every conversation's latest prompt, against
the device pool; the per-tier counters of /admin/stats over the run (with --admin-token);
TTFT percentiles.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import random
import time
from typing import Any

import httpx
import orjson

from tools.benchmarks.client import HttpError, SseConnection
from tools.benchmarks.report import percentiles
from tools.benchmarks.workload import parse_range

ORDERS = ("round-robin", "random")
# /admin/stats counters whose change over the run is reported (tokens, blocks, events)
COUNTERS = (
    "prefix_cache_queries",
    "prefix_cache_hits",
    "kv_offload_host_hits",
    "kv_offload_disk_hits",
    "kv_offload_saves",
    "kv_offload_spills",
    "kv_offload_dropped",
    "kv_offload_fetch_failures",
    "num_preemptions",
)
WORDS = (
    "the a river stone light garden window morning quiet city road letter market music "
    "winter summer harbour train village friend story question answer paper engine bridge "
    "colour forest mountain island kitchen library evening simple careful bright ancient "
    "small large green blue golden silver slowly quickly because although while before "
    "after always never often travel write build remember explain compare describe follow "
    "carry open close listen watch learn teach plan measure count share"
).split()


@dataclasses.dataclass(frozen=True)
class MultiTurnSpec:
    """The conversations: how many, how long, in which order."""

    num_conversations: int
    num_turns: int
    system_words: int  # one system prompt all conversations share (0: none)
    user_words: tuple[int, int]  # each user message: LO..HI words
    max_tokens: int  # each reply
    order: str = "round-robin"
    seed: int = 0

    def __post_init__(self) -> None:
        if self.num_conversations < 1 or self.num_turns < 1:
            raise ValueError("--conversations and --turns must be >= 1")
        if self.order not in ORDERS:
            raise ValueError(f"--turn-order: one of {ORDERS}, got {self.order!r}")
        if self.max_tokens < 1:
            raise ValueError(f"--output-len: must be >= 1, got {self.max_tokens}")

    def system_prompt(self) -> str:
        rng = random.Random(f"{self.seed}:system")
        return " ".join(rng.choice(WORDS) for _ in range(self.system_words))

    def user_message(self, conversation: int, turn: int) -> str:
        """The same words for (conversation, turn) whatever the order or the replies."""
        rng = random.Random(f"{self.seed}:{conversation}:{turn}")
        n = rng.randint(*self.user_words)
        return f"[{conversation}.{turn}] " + " ".join(rng.choice(WORDS) for _ in range(n))

    def turn_order(self) -> list[int]:
        """The conversation of each turn sent, in order (its turn number: how many times it
        came before). Round-robin: 0, 1, .., C-1, 0, 1, ..; random: those, shuffled."""
        order = [c for _ in range(self.num_turns) for c in range(self.num_conversations)]
        if self.order == "random":
            random.Random(f"{self.seed}:order").shuffle(order)
        return order

    def first_messages(self, conversation: int) -> list[dict[str, str]]:
        system = self.system_prompt()
        return [{"role": "system", "content": system}] if system else []


@dataclasses.dataclass
class TurnResult:
    conversation: int
    turn: int
    prompt_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0
    ttft: float = 0.0
    e2e: float = 0.0
    error: str = ""


def _body(model: str, messages: list[dict[str, str]], max_tokens: int) -> bytes:
    return orjson.dumps(
        {
            "model": model,
            "messages": messages,
            "max_tokens": max_tokens,
            "temperature": 0.0,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
    )


async def _turn(
    conn: SseConnection,
    model: str,
    messages: list[dict[str, str]],
    spec: MultiTurnSpec,
    r: TurnResult,
) -> str:
    """Send one turn, fill `r` from the stream; returns the reply's text."""
    start, parts = time.perf_counter(), []
    try:
        async for data in conn.stream(
            "/v1/chat/completions", _body(model, messages, spec.max_tokens)
        ):
            if data == b"[DONE]":
                continue
            chunk = orjson.loads(data)
            if "error" in chunk:
                r.error = f"stream error: {str(chunk['error'].get('message', ''))[:200]}"
            usage = chunk.get("usage")
            if usage:
                r.prompt_tokens = usage["prompt_tokens"]
                r.output_tokens = usage["completion_tokens"]
                details = usage.get("prompt_tokens_details") or {}
                r.cached_tokens = int(details.get("cached_tokens") or 0)
            for choice in chunk.get("choices") or ():
                text = (choice.get("delta") or {}).get("content") or ""
                if text and not r.ttft:
                    r.ttft = time.perf_counter() - start
                parts.append(text)
    except HttpError as e:
        r.error = str(e)
    r.e2e = time.perf_counter() - start
    return "".join(parts)


async def run_conversations(
    url: str, model: str, spec: MultiTurnSpec, concurrency: int
) -> tuple[list[TurnResult], float]:
    """Every turn of every conversation, in the spec's order with at most `concurrency` in
    flight (0: one per conversation); returns the turns (in the order sent) and the
    duration."""
    order = spec.turn_order()
    histories = [spec.first_messages(c) for c in range(spec.num_conversations)]
    # a conversation's turns run one after another: each takes its lock in the order sent
    # (asyncio locks are fair), so turn k+1 starts with turn k's reply in its history
    locks = [asyncio.Lock() for _ in range(spec.num_conversations)]
    counts = [0] * spec.num_conversations
    results: list[TurnResult] = []
    for c in order:
        results.append(TurnResult(c, counts[c]))
        counts[c] += 1
    queue: asyncio.Queue[TurnResult] = asyncio.Queue()
    for r in results:
        queue.put_nowait(r)

    async def worker() -> None:
        conn = SseConnection(url)
        try:
            while not queue.empty():
                r = queue.get_nowait()
                async with locks[r.conversation]:
                    history = histories[r.conversation]
                    user = {"role": "user", "content": spec.user_message(r.conversation, r.turn)}
                    reply = await _turn(conn, model, [*history, user], spec, r)
                    history += [user, {"role": "assistant", "content": reply}]
        finally:
            await conn.close()

    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency or spec.num_conversations)))
    return results, time.perf_counter() - start


def working_set_blocks(results: list[TurnResult], block_size: int) -> int:
    """Blocks of every conversation's latest prompt: what the cache must hold for every
    next turn to find its whole prefix."""
    latest: dict[int, tuple[int, int]] = {}  # conversation -> (turn, prompt tokens)
    for r in results:
        if not r.error and r.turn >= latest.get(r.conversation, (-1, 0))[0]:
            latest[r.conversation] = r.turn, r.prompt_tokens
    return sum(-(-n // block_size) for _, n in latest.values())


def summarize_turns(
    results: list[TurnResult], duration: float, before: dict[str, Any], after: dict[str, Any]
) -> dict[str, Any]:
    ok = [r for r in results if not r.error]
    later = [r for r in ok if r.turn > 0]
    prompt, cached = sum(r.prompt_tokens for r in ok), sum(r.cached_tokens for r in ok)
    later_prompt = sum(r.prompt_tokens for r in later)
    block_size = int(after.get("block_size") or 16)
    return {
        "turns": len(ok),
        "failed": len(results) - len(ok),
        "errors": sorted({r.error for r in results if r.error})[:5],
        "duration_s": duration,
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "hit_rate": cached / max(1, prompt),
        "later_turns_hit_rate": sum(r.cached_tokens for r in later) / max(1, later_prompt),
        "output_tokens": sum(r.output_tokens for r in ok),
        "block_size": block_size,
        "device_pool_blocks": after.get("num_total_blocks", 0),
        "working_set_blocks": working_set_blocks(ok, block_size),
        "server_counters": {k: after[k] - before.get(k, 0) for k in COUNTERS if k in after},
        "ttft_s": percentiles([r.ttft for r in ok if r.ttft]),
        "e2e_s": percentiles([r.e2e for r in ok]),
        "turn_results": [dataclasses.asdict(r) for r in results],
    }


def print_summary(s: dict[str, Any]) -> None:
    ws, pool = s["working_set_blocks"], s["device_pool_blocks"]
    ratio = f" ({ws / pool:.1f}x the device pool)" if pool else ""
    print(
        f"multi-turn: {s['turns']} turns ok, {s['failed']} failed, {s['duration_s']:.1f} s; "
        f"working set {ws} blocks of {s['block_size']}{ratio}, device pool {pool} blocks"
    )
    print(
        f"  prompt tokens {s['prompt_tokens']}, cached {s['cached_tokens']}: hit rate "
        f"{s['hit_rate']:.1%} (turns after the first: {s['later_turns_hit_rate']:.1%})"
    )
    if s["server_counters"]:
        print("  server counters over the run: " + ", ".join(
            f"{k} {v}" for k, v in s["server_counters"].items()
        ))  # fmt: skip
    for key in ("ttft_s", "e2e_s"):
        p = s[key]
        print(
            f"  {key[:-2].upper():5} ms  mean {p['mean'] * 1e3:8.1f}  median "
            f"{p['median'] * 1e3:8.1f}  p90 {p['p90'] * 1e3:8.1f}  p99 {p['p99'] * 1e3:8.1f}"
        )


# --- the command ---------------------------------------------------------------------------
def add_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--workload",
        default="random",
        choices=["random", "multi-turn", "bursts"],
        help="random: --num-prompts independent prompts (or --jsonl); multi-turn: chat "
        "conversations (multi_turn.py; --output-len is each reply's max_tokens); bursts: "
        "steady decode streams under bursts of long prompts (bursts.py)",
    )
    p.add_argument("--conversations", type=int, default=16, help="multi-turn: how many")
    p.add_argument("--turns", type=int, default=6, help="multi-turn: turns per conversation")
    p.add_argument("--system-len", type=int, default=48, help="multi-turn: system prompt words")
    p.add_argument("--user-len", default="40:80", help="multi-turn: N or LO:HI words a message")
    p.add_argument("--turn-order", default="round-robin", choices=list(ORDERS))


def spec_from_args(args: argparse.Namespace) -> MultiTurnSpec:
    return MultiTurnSpec(
        num_conversations=args.conversations,
        num_turns=args.turns,
        system_words=args.system_len,
        user_words=parse_range(args.user_len),
        max_tokens=parse_range(args.output_len)[1],
        order=args.turn_order,
        seed=args.seed,
    )


def admin_stats(url: str, token: str) -> dict[str, Any]:
    """/admin/stats ({} without an admin token or on a refusal)."""
    if not token:
        return {}
    r = httpx.get(url + "/admin/stats", headers={"Authorization": f"Bearer {token}"}, timeout=60)
    return r.json() if r.status_code == 200 else {}


def run(url: str, model: str, spec: MultiTurnSpec, concurrency: int, token: str) -> dict[str, Any]:
    """The whole workload against a server; its summary (see summarize_turns)."""
    before = admin_stats(url, token)
    results, duration = asyncio.run(run_conversations(url, model, spec, concurrency))
    summary = summarize_turns(results, duration, before, admin_stats(url, token))
    return {"spec": {**dataclasses.asdict(spec), "concurrency": concurrency}, **summary}
