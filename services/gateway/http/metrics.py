"""Prometheus metrics at GET /metrics, with vLLM's names under the `shuttle:` prefix, or with
vLLM's own `vllm:` prefix under --metrics-vllm-names (so a vLLM Grafana dashboard or an
autoscaler written for vLLM reads shuttle unchanged).

With several gateway processes (--gateway-processes) each stamps the requests it holds, and
a scrape, whichever process answers it, reads every process's counters and histograms
summed (prometheus_client's multiprocess mode, over files in the run directory): nothing
is counted twice or hidden, and a dead process's counts stay in the sums, as counters
must. The scheduler's figures are read once per scrape, as with one process.

Every request timing is stamped in this one process (the gateway), as the engine client
hands each delta to the HTTP or gRPC front end, so TTFT, ITL and E2E of one request share
one clock and match what a client sees (less the network):

    arrival ──────────▶ first delta with tokens ──▶ ... each delta ... ──▶ final delta
    (generate() call)   TTFT, queue time            ITL per token          E2E

- `request_queue_time_seconds`: the gateway cannot see the scheduler's queues, so this is
  arrival → the first OutputBatch about the request reaching the gateway (any delta, text or
  not). It is an upper bound on the time spent waiting: it also holds tokenisation, the
  prefill step and three hops. It differs from TTFT only when the first delta has no text.
- `inter_token_latency_seconds`: the gap between two deltas of one sequence, divided evenly
  over the tokens of the later delta (one observation per token), so its sum is the decode
  time and its count the tokens after each sequence's first. With `n` > 1 each sequence keeps
  its own clock: the interleaved deltas of its siblings are no gaps of its own.
- Scheduler figures (running/waiting requests, KV usage, preemptions, prefix-cache queries
  and hits in tokens) are read from the scheduler (`engine.stats()`) when /metrics is
  scraped, with a short timeout; if it does not answer, the last values are served.
- `request_success_total{finished_reason}`: one per finished sequence, by the OpenAI name of
  its reason (stop, length, cancelled, timeout, error); a request the client dropped before
  its end counts as cancelled. Requests the engine refused count in
  `request_failure_total{status}` instead.
- `moe_expert_tokens_total{expert}` (a mixture-of-experts model): the (token, expert) pairs
  each expert has computed, summed over the model's MoE layers, from the scheduler's
  `moe_expert_tokens`: an operator sees routing skew. Not broken down by replica.
- Per-request histograms, observed once when the request ends (as vLLM's): its prompt and
  generated tokens (all n sequences together), the most tokens one of its sequences
  generated (`request_max_num_generation_tokens`), its `n` and `max_tokens`, and
  `request_prefill_time_seconds` (arrival → first token: the gateway sees no scheduling
  moment, so this also holds the wait), `request_decode_time_seconds` (first token → last)
  and `request_inference_time_seconds` (their sum), `request_time_per_output_token_seconds`
  (decode time over the longest sequence's tokens after its first). A refused request
  observes none of them; a chat request that left `max_tokens` unset (as many as fit: the
  tokenizer resolves it, out of the gateway's sight) observes no `request_params_max_tokens`.
"""

from __future__ import annotations

import os
import time

from fastapi import FastAPI
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest, multiprocess
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from starlette.responses import Response

from common.messages import FinishReason, GenerateRequest
from services.gateway.engine.client import EngineClient, OutputDelta
from services.gateway.http.scheduler_metrics import SchedulerStats

STATS_TIMEOUT_S = 0.5
# prometheus_client's multiprocess mode: the folder each gateway process writes its
# counters and histograms to (services/launch.py sets it for every gateway process)
MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"
# vLLM's buckets, with finer ones at the low end: the synthetic model answers in microseconds
# fmt: off
TTFT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
                1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3,
               0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
E2E_BUCKETS = (0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0,
               30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
# fmt: on
# token counts and `max_tokens`: 1, 2, 5, 10, 20, 50, ... as vLLM's build_1_2_5_buckets
TOKEN_BUCKETS = tuple(float(m * 10**e) for e in range(7) for m in (1, 2, 5))
N_BUCKETS = (1.0, 2.0, 5.0, 10.0, 20.0)  # vLLM's request_params_n buckets


class GatewayMetrics:
    """The gateway's registry: request timings observed here, scheduler figures on scrape."""

    def __init__(self, engine: EngineClient, vllm_names: bool = False) -> None:
        self.engine = engine
        self.prefix = "vllm" if vllm_names else "shuttle"
        self.registry = CollectorRegistry(auto_describe=True)
        self._exposed: CollectorRegistry | None = None
        self.scheduler = SchedulerStats(lambda: self.model_name, self.prefix)
        self.registry.register(self.scheduler)
        labels = ["model_name"]
        reg, prefix = self.registry, self.prefix

        def hist(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(f"{prefix}:{name}", doc, labels, buckets=buckets, registry=reg)

        def counter(name: str, doc: str, extra: tuple[str, ...] = ()) -> Counter:
            return Counter(f"{prefix}:{name}", doc, [*labels, *extra], registry=reg)

        self.ttft = hist("time_to_first_token_seconds", "Time to first token.", TTFT_BUCKETS)
        self.itl = hist("inter_token_latency_seconds", "Inter-token latency.", ITL_BUCKETS)
        self.e2e = hist("e2e_request_latency_seconds", "End-to-end request latency.", E2E_BUCKETS)
        self.queue = hist(
            "request_queue_time_seconds",
            "Arrival at the gateway to the request's first output there.",
            TTFT_BUCKETS,
        )
        self.prefill_time = hist(
            "request_prefill_time_seconds", "Arrival to the first token.", E2E_BUCKETS
        )
        self.decode_time = hist(
            "request_decode_time_seconds", "First token to the last token.", E2E_BUCKETS
        )
        self.inference_time = hist(
            "request_inference_time_seconds", "Prefill and decode time.", E2E_BUCKETS
        )
        self.request_tpot = hist(
            "request_time_per_output_token_seconds",
            "A request's decode time per output token after the first.",
            ITL_BUCKETS,
        )
        self.request_prompt_tokens = hist(
            "request_prompt_tokens", "Prompt tokens of a request.", TOKEN_BUCKETS
        )
        self.request_generation_tokens = hist(
            "request_generation_tokens",
            "Tokens a request generated (all its sequences).",
            TOKEN_BUCKETS,
        )
        self.request_max_generation_tokens = hist(
            "request_max_num_generation_tokens",
            "Most tokens generated by one sequence of a request.",
            TOKEN_BUCKETS,
        )
        self.params_n = hist("request_params_n", "The request's n.", N_BUCKETS)
        self.params_max_tokens = hist(
            "request_params_max_tokens", "The request's max_tokens.", TOKEN_BUCKETS
        )
        self.prompt_tokens = counter("prompt_tokens", "Prefill tokens processed.")
        self.generation_tokens = counter("generation_tokens", "Generation tokens processed.")
        self.success = counter(
            "request_success", "Finished sequences by reason.", ("finished_reason",)
        )
        self.failure = counter("request_failure", "Requests the engine refused.", ("status",))

    @property
    def model_name(self) -> str:
        return self.engine.model_name

    def observe(self, request: GenerateRequest) -> RequestTimer:
        """A timer for one request, started now (its arrival)."""
        return RequestTimer(self, request.sampling.n, request.sampling.max_tokens)

    async def render(self) -> bytes:
        """The exposition text, after refreshing the scheduler's figures (best effort)."""
        try:
            self.scheduler.update(await self.engine.stats(timeout=STATS_TIMEOUT_S))
        except TimeoutError:
            pass  # keep the last values: a busy or restarting scheduler is no error here
        return generate_latest(self.exposed)

    @property
    def exposed(self) -> CollectorRegistry:
        """What a scrape reads: this registry, or with several gateway processes
        (PROMETHEUS_MULTIPROC_DIR, set by the supervisor) every process's request metrics
        summed from their files, this process's living or not, plus the scheduler's."""
        if self._exposed is None:
            path = os.environ.get(MULTIPROC_ENV)
            if not path:
                self._exposed = self.registry
            else:
                self._exposed = CollectorRegistry()
                multiprocess.MultiProcessCollector(self._exposed, path)
                self._exposed.register(self.scheduler)
        return self._exposed


class RequestTimer:
    """Stamps one request's deltas; the engine client calls `delta` then `end` once."""

    __slots__ = (
        "metrics",
        "model",
        "arrival",
        "last",
        "first_seen",
        "first_token",
        "running",
        "prompt_counted",
        "ended",
        "n",
        "max_tokens",
        "first_token_at",
        "last_token_at",
        "num_prompt_tokens",
        "num_output_tokens",
    )

    def __init__(self, metrics: GatewayMetrics, n: int, max_tokens: int) -> None:
        self.metrics = metrics
        self.model = metrics.model_name
        self.arrival = time.perf_counter()
        self.last: dict[int, float] = {}  # sequence index -> when its last token came
        self.first_seen = self.first_token = self.prompt_counted = self.ended = False
        self.running = self.n = n
        self.max_tokens = max_tokens
        self.first_token_at = self.last_token_at = 0.0
        self.num_prompt_tokens = 0
        self.num_output_tokens: dict[int, int] = {}  # sequence index -> tokens so far

    def delta(self, delta: OutputDelta) -> None:
        now = time.perf_counter()
        m, model = self.metrics, self.model
        if not self.first_seen:
            self.first_seen = True
            m.queue.labels(model).observe(now - self.arrival)
        if not self.prompt_counted and delta.num_prompt_tokens:
            self.prompt_counted = True
            self.num_prompt_tokens = delta.num_prompt_tokens
            m.prompt_tokens.labels(model).inc(delta.num_prompt_tokens)
        num_tokens = len(delta.token_ids)
        if num_tokens:
            m.generation_tokens.labels(model).inc(num_tokens)
            self.num_output_tokens[delta.index] = (
                self.num_output_tokens.get(delta.index, 0) + num_tokens
            )
            self.last_token_at = now
            if not self.first_token:
                self.first_token = True
                self.first_token_at = now
                m.ttft.labels(model).observe(now - self.arrival)
            last = self.last.get(delta.index)
            if last is None:  # a sequence's first token: its latency is a TTFT, not an ITL
                num_tokens -= 1
                last = self.arrival
            gap = (now - last) / max(1, num_tokens)
            itl = m.itl.labels(model)
            for _ in range(num_tokens):
                itl.observe(gap)
            self.last[delta.index] = now
        if delta.finish_reason != FinishReason.NONE:
            self.running -= 1
            m.success.labels(model, delta.finish_reason.openai or "").inc()
        if delta.last:
            self._end(now)

    def failed(self, status: int) -> None:
        self.metrics.failure.labels(self.model, str(status)).inc()
        self.ended = True

    def end(self) -> None:
        """The engine client is done with the request: a stream left unfinished was cancelled."""
        if self.ended:
            return
        if self.running > 0:
            cancelled = FinishReason.CANCELLED.openai or "cancelled"
            self.metrics.success.labels(self.model, cancelled).inc(self.running)
            self.running = 0
        self._end(time.perf_counter())

    def _end(self, now: float) -> None:
        if self.ended:
            return
        self.ended = True
        m, model = self.metrics, self.model
        m.e2e.labels(model).observe(now - self.arrival)
        m.request_prompt_tokens.labels(model).observe(self.num_prompt_tokens)
        m.request_generation_tokens.labels(model).observe(sum(self.num_output_tokens.values()))
        longest = max(self.num_output_tokens.values(), default=0)
        m.request_max_generation_tokens.labels(model).observe(longest)
        m.params_n.labels(model).observe(self.n)
        if self.max_tokens:  # 0: as many as fit the context, resolved by the tokenizer
            m.params_max_tokens.labels(model).observe(self.max_tokens)
        if self.first_token:  # a request with no token had neither a prefill nor a decode
            prefill = self.first_token_at - self.arrival
            decode = self.last_token_at - self.first_token_at
            m.prefill_time.labels(model).observe(prefill)
            m.decode_time.labels(model).observe(decode)
            m.inference_time.labels(model).observe(prefill + decode)
            if longest > 1:
                m.request_tpot.labels(model).observe(decode / (longest - 1))


def install_metrics(app: FastAPI, engine: EngineClient, vllm_names: bool = False) -> GatewayMetrics:
    """Serve GET /metrics on `app`, and time every request the engine takes; `vllm_names`:
    under vLLM's `vllm:` prefix instead of `shuttle:`."""
    metrics = GatewayMetrics(engine, vllm_names)
    engine.observer = metrics.observe

    async def metrics_route() -> Response:
        return Response(await metrics.render(), media_type=CONTENT_TYPE_LATEST)

    app.add_api_route("/metrics", metrics_route, methods=["GET"], include_in_schema=False)
    app.state.metrics = metrics
    return metrics
