"""services/launch.py: what `shuttle serve` prints as it starts; each replica's GPUs."""

from __future__ import annotations

from pathlib import Path

import pytest

from common.config import Config
from common.messages import Progress, Ready
from services.launch import startup_line


def test_each_stage_and_each_ready_is_a_line_with_the_time_since_the_start() -> None:
    stage = Progress(name="worker", stage="loading weights from /m, building kernels")
    assert startup_line(stage, 1.25) == (
        "shuttle: [  1.2s] worker: loading weights from /m, building kernels"
    )
    assert startup_line(Ready(name="gateway", info={"port": 1}), 6.0) == (
        "shuttle: [  6.0s] gateway ready"
    )


@pytest.mark.parametrize("visible", ["0,1", "0"])
def test_the_supervisor_gives_each_replica_its_gpus(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, visible: str
) -> None:
    from services import launch

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    config = Config().replace(
        server={"run_dir": str(tmp_path)},
        model={"device": "cuda"},
        cache={"gpu_memory_utilization": 0.8},
        data_parallel={"data_parallel_size": 2},
    )
    sup = launch.Supervisor(config)
    try:
        sup.write_replica_configs()
    finally:
        sup.inbox.close(linger=0)
    envs = [sup._env[f"worker-{i}"]["CUDA_VISIBLE_DEVICES"] for i in range(2)]
    utils = [
        Config.from_json((tmp_path / f"config-replica-{i}.json").read_bytes()).cache
        for i in range(2)
    ]
    if visible == "0,1":
        assert envs == ["0", "1"] and [u.gpu_memory_utilization for u in utils] == [0.8, 0.8]
    else:  # one GPU for both: each takes half of what one would
        assert envs == ["0", "0"] and [u.gpu_memory_utilization for u in utils] == [0.4, 0.4]


def test_the_gateway_processes_share_the_port_the_supervisor_opened(tmp_path: Path) -> None:
    from common.topology import process_names
    from services import launch

    config = Config().replace(
        server={"run_dir": str(tmp_path), "port": 0, "grpc_port": 0, "gateway_processes": 2}
    )
    sup = launch.Supervisor(config)
    try:
        sup.open_ports()
        specs = dict(sup.specs())
        fd = str(sup.listener.fileno()) if sup.listener else ""
        port, grpc_port = sup.config.server.port, sup.config.server.grpc_port
    finally:
        sup.shutdown()
    assert list(specs) == process_names(sup.config)  # the console lists the same names
    assert specs["gateway-1"][-4:] == ["--index", "1", "--listen-fd", fd]
    assert port > 0 and grpc_port > 0  # the ports bound, in config.json for every child
    written = Config.from_json((tmp_path / "config.json").read_bytes()).server
    assert (written.port, written.grpc_port) == (port, grpc_port)
    # every gateway process hears of a death, each scheduler of a gateway's
    assert sup._told_of_death("tokenizer-0") == ["gateway-0", "gateway-1", "scheduler"]
    assert sup._told_of_death("gateway-1") == ["gateway-0", "scheduler"]


def test_gateway_processes_default_to_two_where_the_cores_allow(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from services import launch

    config = Config().replace(server={"run_dir": str(tmp_path)}, model={"model": "synthetic"})
    monkeypatch.setattr("common.topology.os.cpu_count", lambda: 8)
    assert launch.prepare(config).server.gateway_processes == 2
    monkeypatch.setattr("common.topology.os.cpu_count", lambda: 1)
    assert launch.prepare(config).server.gateway_processes == 1
    one = config.replace(server={"gateway_processes": 1})
    monkeypatch.setattr("common.topology.os.cpu_count", lambda: 8)
    assert launch.prepare(one).server.gateway_processes == 1


def test_gateway_processes_fit_the_gateway_inboxes_given(tmp_path: Path) -> None:
    from common.config import ConfigError
    from services import launch

    config = Config().replace(
        server={"run_dir": str(tmp_path)},
        model={"model": "synthetic"},
        addresses={"gateway_addr": "tcp://127.0.0.1:5550"},
    )
    assert launch.prepare(config).server.gateway_processes == 1  # (0: as many as given)
    with pytest.raises(ConfigError, match="--gateway-processes 2 needs 2 --gateway-addr"):
        launch.prepare(config.replace(server={"gateway_processes": 2}))
