"""The replica layout (common/topology.py): names, addresses, GPUs per replica."""

from __future__ import annotations

import pytest

from common.config import Config
from common.topology import (
    engine_entry_addr,
    replica_addrs,
    replica_config,
    replica_gpus,
    replica_name,
)


def test_one_replica_keeps_the_old_layout() -> None:
    config = Config().replace(server={"run_dir": "/run"})
    assert replica_name("scheduler", 0, 1) == "scheduler"
    assert replica_addrs(config, "scheduler") == ["ipc:///run/scheduler.sock"]
    assert engine_entry_addr(config) == "ipc:///run/scheduler.sock"


def test_several_replicas_have_their_own_addresses() -> None:
    config = Config().replace(server={"run_dir": "/run"}, data_parallel={"data_parallel_size": 2})
    assert engine_entry_addr(config) == "ipc:///run/router.sock"
    one = replica_config(config, 1)
    assert one.addr("scheduler") == "ipc:///run/scheduler-1.sock"
    assert one.addr("worker") == "ipc:///run/worker-1.sock"
    assert one.data_parallel.replica_index == 1


def test_explicit_addresses_must_name_every_replica() -> None:
    config = Config().replace(
        data_parallel={"data_parallel_size": 2, "scheduler_addrs": "tcp://s0:1,tcp://s1:1"}
    )
    assert replica_addrs(config, "scheduler") == ["tcp://s0:1", "tcp://s1:1"]
    short = config.replace(data_parallel={"worker_addrs": "tcp://w0:1"})
    with pytest.raises(ValueError):
        replica_addrs(short, "worker")


def test_replicas_split_the_gpus_or_share_them() -> None:
    assert replica_gpus(["0", "1", "2", "3"], 2) == [["0", "1"], ["2", "3"]]
    assert replica_gpus(["4", "7"], 2) == [["4"], ["7"]]
    assert replica_gpus(["0", "1", "2"], 2) == [["0"], ["1"]]
    assert replica_gpus(["0"], 2) == [["0"], ["0"]]
