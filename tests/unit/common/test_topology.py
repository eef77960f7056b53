"""The replica layout (common/topology.py): names, addresses, GPUs per replica."""

from __future__ import annotations

import pytest

from common.config import Config
from common.topology import (
    engine_entry_addr,
    gateway_addrs,
    gateway_index,
    gateway_name,
    process_names,
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


def test_gateway_processes_have_their_own_inboxes() -> None:
    one = Config().replace(server={"run_dir": "/run", "gateway_processes": 1})
    assert gateway_addrs(one) == ["ipc:///run/gateway.sock"]
    two = Config().replace(server={"run_dir": "/run", "gateway_processes": 2})
    assert gateway_addrs(two) == ["ipc:///run/gateway-0.sock", "ipc:///run/gateway-1.sock"]
    assert [gateway_name(i, 2) for i in range(2)] == ["gateway-0", "gateway-1"]
    assert gateway_index("gateway-1") == 1
    assert gateway_index("gateway") is None and gateway_index("tokenizer-1") is None
    # (a process started on its own, with the field's 0, is the one gateway)
    assert gateway_addrs(Config().replace(server={"run_dir": "/run"})) == [
        "ipc:///run/gateway.sock"
    ]


def test_explicit_gateway_addresses_must_name_every_process() -> None:
    config = Config().replace(
        server={"gateway_processes": 2}, addresses={"gateway_addr": "tcp://a:1"}
    )
    with pytest.raises(ValueError, match="one per gateway process"):
        gateway_addrs(config)
    both = config.replace(addresses={"gateway_addr": "tcp://a:1, tcp://b:2"})
    assert gateway_addrs(both) == ["tcp://a:1", "tcp://b:2"]


def test_process_names_are_every_process_of_the_topology() -> None:
    config = Config().replace(server={"num_tokenizers": 2, "gateway_processes": 2})
    assert process_names(config) == [
        "worker",
        "scheduler",
        "detokenizer",
        "tokenizer-0",
        "tokenizer-1",
        "gateway-0",
        "gateway-1",
    ]
    tp = Config().replace(parallel={"tensor_parallel_size": 2}, server={"gateway_processes": 1})
    assert process_names(tp)[:3] == ["worker", "worker-rank-1", "scheduler"]
    assert process_names(tp)[-1] == "gateway"
    dp = Config().replace(data_parallel={"data_parallel_size": 2})
    assert process_names(dp)[:5] == ["worker-0", "scheduler-0", "worker-1", "scheduler-1", "router"]
