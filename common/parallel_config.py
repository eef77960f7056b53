"""Data parallelism's config section; the replica layout it implies is common/topology.py's."""

from __future__ import annotations

import dataclasses

from common.config_base import ConfigError, config_field

ROUTINGS = ("prefix", "round-robin")


@dataclasses.dataclass(frozen=True)
class DataParallelConfig:
    data_parallel_size: int = config_field(1, "engine replicas (scheduler + worker each)")
    dp_routing: str = config_field(
        "prefix",
        "prefix: to the replica holding the request's leading blocks (bounded by "
        "--dp-load-bound), else the least loaded; round-robin: in turn",
    )
    dp_load_bound: float = config_field(
        1.25,
        "prefix routing: a replica takes a request only while its load (running + waiting "
        "requests) stays within this multiple of the mean (at least 1)",
    )
    replica_index: int = config_field(0, "this process's replica (set by the supervisor/compose)")
    router_addr: str = config_field("", "router inbox (data parallelism)")
    scheduler_addrs: str = config_field("", "comma-separated scheduler inboxes, one per replica")
    worker_addrs: str = config_field("", "comma-separated worker inboxes, one per replica")

    def __post_init__(self) -> None:
        if self.data_parallel_size < 1:
            raise ConfigError("--data-parallel-size must be >= 1")
        if self.dp_routing not in ROUTINGS:
            raise ConfigError("--dp-routing must be prefix or round-robin")
        if self.dp_load_bound < 1.0:
            raise ConfigError("--dp-load-bound must be >= 1")
        if not 0 <= self.replica_index < self.data_parallel_size:
            raise ConfigError("--replica-index must be in [0, --data-parallel-size)")
