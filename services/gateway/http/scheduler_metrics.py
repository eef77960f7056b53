"""The scheduler's figures on /metrics (services/gateway/http/metrics.py): a collector over
the scheduler's last stats answer, read once per scrape. Gauges (running and waiting
requests, KV usage and pool size, resident weight bytes, the KV offload tiers, handovers in
flight, speculative decoding's acceptance) and the scheduler's own counters (preemptions,
prefix-cache queries and hits, the offload tiers' hits and failures), vLLM's
`cache_config_info`, and, where they apply, each data-parallel replica's values labelled
`replica`, the router's decisions, the prefill/decode handovers, and a mixture of experts'
(token, expert) pairs per expert."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric


class SchedulerStats:
    """A collector over the scheduler's last stats answer: gauges and its own counters."""

    GAUGES = (
        ("num_requests_running", "num_running", "Requests in model execution batches."),
        ("num_requests_waiting", "num_waiting", "Requests waiting to be processed."),
        ("kv_cache_usage_perc", "kv_cache_usage", "KV-cache usage, 1 means 100 percent."),
        ("kv_cache_num_blocks", "num_total_blocks", "KV blocks in the pool."),
        (
            "model_weight_bytes",
            "model_weight_bytes",
            "Bytes of model weights resident in the worker (quantized ones as stored).",
        ),
        ("kv_offload_host_blocks", "kv_offload_host_blocks", "Prefix-cache blocks in host memory."),
        ("kv_offload_host_bytes", "kv_offload_host_bytes", "Bytes of those blocks (this rank's)."),
        ("kv_offload_disk_blocks", "kv_offload_disk_blocks", "Prefix-cache blocks on disk."),
        ("kv_offload_disk_bytes", "kv_offload_disk_bytes", "Bytes of those files (this rank's)."),
        (
            "spec_decode_acceptance_rate",
            "spec_acceptance_rate",
            "Speculative decoding: accepted / proposed draft tokens.",
        ),
        (
            "spec_decode_mean_accepted_length",
            "spec_mean_accepted_length",
            "Speculative decoding: tokens per verification step (accepted drafts + 1).",
        ),
    )
    COUNTERS = (
        ("num_preemptions", "num_preemptions", "Cumulative preemptions."),
        ("prefix_cache_queries", "prefix_cache_queries", "Prefix-cache queries, in tokens."),
        ("prefix_cache_hits", "prefix_cache_hits", "Prefix-cache hits, in tokens."),
        (
            "kv_offload_host_hits",
            "kv_offload_host_hits",
            "Prefix-cache blocks copied back into the KV pool from host memory.",
        ),
        (
            "kv_offload_disk_hits",
            "kv_offload_disk_hits",
            "Prefix-cache blocks read up from disk into host memory.",
        ),
        (
            "kv_offload_fetch_failures",
            "kv_offload_fetch_failures",
            "Prefix-cache files discarded on read (missing, or not matching their key).",
        ),
        (
            "spec_decode_num_drafts",
            "spec_num_drafts",
            "Speculative decoding: verification steps with at least one draft token.",
        ),
        (
            "spec_decode_num_draft_tokens",
            "spec_num_draft_tokens",
            "Speculative decoding: draft tokens proposed.",
        ),
        (
            "spec_decode_num_accepted_tokens",
            "spec_num_accepted_tokens",
            "Speculative decoding: draft tokens accepted.",
        ),
    )

    # prefill/decode replicas (services/scheduler/handover.py): per replica, only where the
    # replicas have roles; TTFT's parts are sums (divide by the sequences handed over)
    HANDOVER = (
        ("kv_handover_sequences", "kv_handover_num_handed_over",
         "Prefill/decode: sequences a prefill replica handed over."),
        ("kv_handover_received_sequences", "kv_handover_num_received",
         "Prefill/decode: sequences a decode replica took."),
        ("kv_handover_refused", "kv_handover_num_refused",
         "Prefill/decode: hand-overs refused (another version, no worker) or cancelled."),
        ("kv_handover_sent_bytes", "kv_handover_bytes_sent", "Prefill/decode: KV bytes sent."),
        ("kv_handover_received_bytes", "kv_handover_bytes_received",
         "Prefill/decode: KV bytes received."),
        ("kv_handover_received_blocks", "kv_handover_blocks_received",
         "Prefill/decode: blocks imported into the decode replica's pool."),
        ("kv_handover_cached_blocks", "kv_handover_blocks_hit",
         "Prefill/decode: blocks the decode replica cached already (not moved)."),
        ("kv_handover_failed_blocks", "kv_handover_blocks_failed",
         "Prefill/decode: blocks that failed their checks on arrival (recomputed)."),
        ("kv_handover_prefill_queue_seconds", "kv_handover_prefill_queue_s",
         "Prefill/decode: TTFT's part waiting on the prefill replica, summed."),
        ("kv_handover_prefill_seconds", "kv_handover_prefill_s",
         "Prefill/decode: TTFT's part computing the prompt on the prefill replica, summed."),
        ("kv_handover_transfer_seconds", "kv_handover_transfer_s",
         "Prefill/decode: export, travel and import of the blocks, summed."),
    )  # fmt: skip
    HANDOVER_GAUGES = (
        ("kv_handover_exports_in_flight", "kv_handover_num_exporting",
         "Prefill/decode: sequences whose blocks a prefill replica is exporting now."),
        ("kv_handover_imports_in_flight", "kv_handover_num_importing",
         "Prefill/decode: sequences whose blocks a decode replica is importing now."),
    )  # fmt: skip

    def __init__(self, model_name: Callable[[], str], prefix: str = "shuttle") -> None:
        self.model_name = model_name
        self.prefix = prefix
        self.last: dict[str, float] = {}
        # data parallelism: each replica's last values, exported labelled replica="<i>", and
        # the router's decisions
        self.last_by_replica: dict[str, dict[str, float]] = {}
        self.roles: dict[str, str] = {}  # prefill/decode replicas: each one's role
        self.routed: dict[str, float] = {}
        # a mixture of experts: (token, expert) pairs per expert (the scheduler's
        # moe_expert_tokens), exported as moe_expert_tokens_total{expert="<i>"}
        self.expert_tokens: list[int] = []
        # the KV pool's settings, as vLLM's cache_config_info labels them
        self.cache_config: dict[str, str] = {}

    def update(self, stats: dict[str, Any]) -> None:
        if stats.get("kv_cache_dtype"):
            self.cache_config = {
                "cache_dtype": str(stats["kv_cache_dtype"]),
                "block_size": str(stats.get("block_size", "")),
                "num_gpu_blocks": str(stats.get("num_total_blocks", "")),
            }
        router = stats.get("router") or {}
        for how in ("prefix", "least_loaded"):
            if isinstance(router.get(f"num_{how}_routed"), int | float):
                self.routed[how] = float(router[f"num_{how}_routed"])
        for row in stats.get("replicas", ()):
            if row.get("ready"):
                self.last_by_replica[str(row["replica"])] = self._values(row)
                if isinstance(row.get("role"), str):
                    self.roles[str(row["replica"])] = row["role"]
        if stats.get("ready", True):
            self.last.update(self._values(stats))
            experts = stats.get("moe_expert_tokens")
            if isinstance(experts, list):
                self.expert_tokens = [int(n) for n in experts]

    def _values(self, stats: dict[str, Any]) -> dict[str, float]:
        return {
            key: float(stats[key])
            for _, key, _ in (*self.GAUGES, *self.COUNTERS, *self.HANDOVER)
            if isinstance(stats.get(key), int | float)
        }

    def collect(self) -> Iterator[Metric]:
        if self.cache_config:
            keys = sorted(self.cache_config)
            info = GaugeMetricFamily(
                f"{self.prefix}:cache_config_info",
                "The KV cache's settings (cache_dtype: the KV rows' dtype, --kv-cache-dtype).",
                labels=["model_name", *keys],
            )
            info.add_metric([self.model_name(), *(self.cache_config[k] for k in keys)], 1.0)
            yield info
        if self.last_by_replica:
            yield from self._collect_by_replica()
            return
        model = self.model_name()
        gauges: tuple[tuple[str, str, str], ...] = self.GAUGES
        if self.prefix == "vllm":  # the name older vLLM dashboards and autoscalers query
            gauges = (*gauges, ("gpu_cache_usage_perc", "kv_cache_usage", "KV-cache usage."))
        for name, key, doc in gauges:
            g = GaugeMetricFamily(f"{self.prefix}:{name}", doc, labels=["model_name"])
            g.add_metric([model], self.last.get(key, 0.0))
            yield g
        for name, key, doc in self.COUNTERS:
            c = CounterMetricFamily(f"{self.prefix}:{name}", doc, labels=["model_name"])
            c.add_metric([model], self.last.get(key, 0.0))
            yield c
        if self.expert_tokens:
            experts = CounterMetricFamily(
                f"{self.prefix}:moe_expert_tokens",
                "Mixture of experts: (token, expert) pairs each expert computed, summed over "
                "the model's MoE layers (routing skew).",
                labels=["model_name", "expert"],
            )
            for e, n in enumerate(self.expert_tokens):
                experts.add_metric([model, str(e)], float(n))
            yield experts

    def _collect_by_replica(self) -> Iterator[Metric]:
        model, labels = self.model_name(), ["model_name", "replica"]
        routed = CounterMetricFamily(
            f"{self.prefix}:dp_routed_requests",
            "Data parallelism: requests the router sent by prefix affinity (prefix) or to the "
            "least-loaded replica (least_loaded).",
            labels=["model_name", "how"],
        )
        for how, value in sorted(self.routed.items()):
            routed.add_metric([model, how], value)
        yield routed
        for families, kind in (
            (self.GAUGES, GaugeMetricFamily),
            (self.COUNTERS, CounterMetricFamily),
        ):
            for name, key, doc in families:
                family = kind(f"{self.prefix}:{name}", doc, labels=labels)
                for replica, values in sorted(self.last_by_replica.items()):
                    family.add_metric([model, replica], values.get(key, 0.0))
                yield family
        if self.roles:
            yield from self._collect_handover(model, labels)

    def _collect_handover(self, model: str, labels: list[str]) -> Iterator[Metric]:
        """Prefill/decode replicas: each one's role, and its hand-over counters."""
        roles = GaugeMetricFamily(
            f"{self.prefix}:replica_role_info",
            "Prefill/decode: each replica's role (join it to the per-replica queue depths).",
            labels=[*labels, "role"],
        )
        for replica, role in sorted(self.roles.items()):
            roles.add_metric([model, replica, role], 1.0)
        yield roles
        for kind, metrics in (
            (CounterMetricFamily, self.HANDOVER),
            (GaugeMetricFamily, self.HANDOVER_GAUGES),
        ):
            for name, key, doc in metrics:
                family = kind(f"{self.prefix}:{name}", doc, labels=labels)
                for replica, values in sorted(self.last_by_replica.items()):
                    family.add_metric([model, replica], values.get(key, 0.0))
                yield family
