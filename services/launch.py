"""`shuttle serve`: start every process on this host, wait until each is ready, supervise.

    supervisor ─spawns─▶ worker, scheduler, detokenizer, tokenizer×N, gateway×G
        ▲                    │ each sends Ready to the supervisor's inbox once started
        └────────────────────┘

The supervisor opens the HTTP port (and holds the gRPC port) itself, and every gateway
process serves on it (services/gateway/listen.py): with G > 1 a gateway's death loses only
its own connections, and it is restarted alone.

On SIGINT/SIGTERM, or when a child dies, every child gets SIGTERM (SIGKILL after a grace
period) and the run directory with its ipc sockets is removed: no orphans, no stale files.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import zmq

from common import codec
from common.config import Config, ConfigError, add_flags, from_args
from common.curve import CurveKeys, uses_curve
from common.messages import Drain, Drained, ProcessDown, Progress, Ready
from common.model_paths import is_synthetic_spec, model_display_name, resolve_model_path
from common.topology import (
    default_gateway_processes,
    gateway_addrs,
    gateway_index,
    gateway_name,
    kv_transfer_dir,
    num_gateways,
    replica_addrs,
    replica_config,
    replica_gpus,
    replica_name,
    router_addr,
)
from services.gateway.listen import hold_grpc_port, listen_http
from services.tokenizer.chat_template import load_chat_template
from services.worker_group import WORKER, check_parallel, is_worker_rank, rank_specs, stop_all

_GRACE_S = 10.0


class Supervisor:
    def __init__(self, config: Config) -> None:
        self.config = config
        self.children: dict[str, subprocess.Popen[bytes]] = {}
        self.commands: dict[str, list[str]] = {}
        self._env: dict[str, dict[str, str]] = {}  # extra environment of some children
        self._restarts: dict[str, list[float]] = {}
        self._peers: dict[str, zmq.Socket] = {}
        self.ready: dict[str, dict] = {}
        self._stop = False
        self.listener: socket.socket | None = None  # the HTTP port, once open_ports() ran
        self._grpc_hold: socket.socket | None = None
        # with --curve-dir, a tcp:// supervisor inbox and the notices it sends are CURVE
        # links like every other (ipc:// stays a local socket file)
        curve_dir = config.addresses.curve_dir
        self.curve = CurveKeys.load(curve_dir) if curve_dir else None
        ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self.inbox = ctx.socket(zmq.PULL)
        self.inbox.setsockopt(zmq.LINGER, 0)
        addr = config.addr("supervisor")
        if self.curve is not None and uses_curve(addr):
            self.curve.serve(self.inbox)
        self.inbox.bind(config.bind_addr(addr))

    def specs(self) -> list[tuple[str, list[str]]]:
        base = [sys.executable, "-m"]
        cfg = ["--config-file", str(Path(self.config.server.run_dir) / "config.json")]
        specs = [*self._replica_specs(base), ("detokenizer", [*base, "services.detokenizer", *cfg])]
        specs += [
            (f"tokenizer-{i}", [*base, "services.tokenizer", *cfg, "--index", str(i)])
            for i in range(self.config.server.num_tokenizers)
        ]
        specs += self._gateway_specs([*base, "services.gateway", *cfg])
        return specs

    def _gateway_specs(self, command: list[str]) -> list[tuple[str, list[str]]]:
        """Each gateway process, on the listening socket open_ports() opened."""
        n = num_gateways(self.config)
        fd = [] if self.listener is None else ["--listen-fd", str(self.listener.fileno())]
        return [(gateway_name(i, n), [*command, "--index", str(i), *fd]) for i in range(n)]

    def open_ports(self) -> None:
        """Open the HTTP port and hold the gRPC port every gateway process serves on
        (services/gateway/listen.py); the config (and config.json) names the ports bound."""
        server = self.config.server
        self.listener = listen_http(server.host, server.port)
        ports = {"port": self.listener.getsockname()[1]}
        if server.grpc_port >= 0:
            self._grpc_hold = hold_grpc_port(server.host, server.grpc_port)
            ports["grpc_port"] = self._grpc_hold.getsockname()[1]
        self.config = self.config.replace(server=ports)
        (Path(server.run_dir) / "config.json").write_bytes(self.config.to_json())
        # /metrics sums every gateway process's request metrics, kept in files here
        # (services/gateway/http/metrics.py); a fresh folder, as multiprocess mode needs
        metrics = Path(server.run_dir) / "gateway-metrics"
        shutil.rmtree(metrics, ignore_errors=True)
        metrics.mkdir(parents=True)
        for name in self.gateways:
            # (prometheus_client's own variable; importing the metrics module here would
            # cost the supervisor a second of start-up)
            self._env.setdefault(name, {})["PROMETHEUS_MULTIPROC_DIR"] = str(metrics)

    def _replica_specs(self, base: list[str]) -> list[tuple[str, list[str]]]:
        """Each engine replica's worker and scheduler (with --data-parallel-size N > 1: on
        the replica's own config, `config-replica-<i>.json`), then the router. One replica's
        worker may be a tensor-parallel group: "worker" and "worker-rank-R"."""
        size = self.config.data_parallel.data_parallel_size
        run_dir = Path(self.config.server.run_dir)
        specs = []
        for i in range(size):
            name = "config.json" if size == 1 else f"config-replica-{i}.json"
            cfg = ["--config-file", str(run_dir / name)]
            if size == 1:
                specs += rank_specs(self.config, cfg)
            else:
                specs.append((replica_name("worker", i, size), [*base, "gpu_worker", *cfg]))
            specs.append((replica_name("scheduler", i, size), [*base, "services.scheduler", *cfg]))
        if size > 1:
            specs.append(
                (
                    "router",
                    [*base, "services.router", "--config-file", str(run_dir / "config.json")],
                )
            )
        return specs

    def write_replica_configs(self) -> None:
        """Each replica's config; on CUDA each replica's worker its own GPUs, or, with fewer
        GPUs than replicas, a share of --gpu-memory-utilization each."""
        size = self.config.data_parallel.data_parallel_size
        if size == 1:
            return
        visible = _visible_gpus() if self.config.model.device == "cuda" else []
        gpus = replica_gpus(visible, size) if visible else []
        util = self.config.cache.gpu_memory_utilization
        for i in range(size):
            config = replica_config(self.config, i)
            if gpus:
                self._env[replica_name("worker", i, size)] = {
                    "CUDA_VISIBLE_DEVICES": ",".join(gpus[i])
                }
                if gpus[i] == gpus[(i + 1) % size]:  # shared: size replicas on these GPUs
                    config = config.replace(cache={"gpu_memory_utilization": util / size})
            path = Path(self.config.server.run_dir) / f"config-replica-{i}.json"
            path.write_bytes(config.to_json())

    def _popen(self, name: str) -> subprocess.Popen[bytes]:
        env = {**os.environ, **self._env[name]} if name in self._env else None
        # a gateway process inherits the listening socket
        fds = (self.listener.fileno(),) if self._is_gateway(name) and self.listener else ()
        return subprocess.Popen(self.commands[name], cwd=_repo_root(), env=env, pass_fds=fds)

    def _is_gateway(self, name: str) -> bool:
        return name == "gateway" or gateway_index(name) is not None

    @property
    def gateways(self) -> list[str]:
        n = num_gateways(self.config)
        return [gateway_name(i, n) for i in range(n)]

    def start(self) -> None:
        self.open_ports()
        self.write_replica_configs()
        self.commands = dict(self.specs())
        for name in self.commands:
            self.children[name] = self._popen(name)

    def wait_ready(self) -> None:
        started = time.monotonic()
        deadline = started + self.config.server.ready_timeout
        print(f"shuttle: starting {', '.join(self.children)}", flush=True)
        while len(self.ready) < len(self.children):
            self._check_children()
            if self._stop:
                raise KeyboardInterrupt
            if time.monotonic() > deadline:
                missing = sorted(set(self.children) - set(self.ready))
                raise TimeoutError(
                    f"not ready after {self.config.server.ready_timeout}s: {missing}"
                )
            if self.inbox.poll(200):
                msg = codec.decode(self.inbox.recv())
                if isinstance(msg, Ready | Progress):
                    print(startup_line(msg, time.monotonic() - started), flush=True)
                if isinstance(msg, Ready):
                    self.ready[msg.name] = msg.info
        self._wait_healthy(deadline)

    def _wait_healthy(self, deadline: float) -> None:
        url = f"http://{self._client_host()}:{self.port}/health"
        while time.monotonic() < deadline and not self._stop:
            self._check_children()
            try:
                with urllib.request.urlopen(url, timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.1)
        raise TimeoutError("gateway never reported healthy")

    @property
    def port(self) -> int:
        if self.listener is not None:
            return int(self.listener.getsockname()[1])
        return int(self.ready[self.gateways[0]]["port"])

    def grpc_banner(self) -> str:
        """The banner's gRPC part: ' grpc HOST:PORT', or '' when the gateway serves none."""
        port = self.ready[self.gateways[0]].get("grpc_port")
        return "" if port is None else f" grpc {self._client_host()}:{port}"

    def _client_host(self) -> str:
        host = self.config.server.host
        return "127.0.0.1" if host in ("0.0.0.0", "") else host

    def _check_children(self) -> None:
        for name, proc in self.children.items():
            if proc.poll() is not None:
                raise ChildDied(f"{name} exited with code {proc.returncode}")

    def supervise(self) -> None:
        """Restart a process that dies (a few times a minute at most); tell the gateway and
        the scheduler, so requests in flight through it fail with a retryable error."""
        while not self._stop:
            for name, proc in list(self.children.items()):
                # (a rank restarted with its group this round is a new process already)
                if proc.poll() is not None and not self._stop and self.children[name] is proc:
                    self._restart(name, proc.returncode)
            self._drain_inbox()
            time.sleep(0.1)

    def _restart(self, name: str, code: int) -> None:
        """Start `name` again; a worker rank takes its whole tensor-parallel group along."""
        unit = WORKER if is_worker_rank(name) else name
        now = time.monotonic()
        recent = [t for t in self._restarts.get(unit, []) if now - t < 60.0]
        if len(recent) >= self.config.server.max_restarts:
            raise ChildDied(
                f"{name} died {len(recent) + 1} times within a minute (last exit code {code})"
            )
        self._restarts[unit] = [*recent, now]
        print(
            f"shuttle: {name} exited with code {code}; restarting {unit if unit != name else 'it'}",
            file=sys.stderr,
            flush=True,
        )
        names = [name]
        if unit == WORKER:  # the group lives and dies together, on a fresh rendezvous
            names = [n for n in self.children if is_worker_rank(n)]
            stop_all([self.children[n] for n in names])
            cfg = ["--config-file", str(Path(self.config.server.run_dir) / "config.json")]
            self.commands.update(rank_specs(self.config, cfg))
        notice = codec.encode(ProcessDown(name=unit, exit_code=code))
        for peer in self._told_of_death(unit):
            self._send(peer, notice)
        for n in names:
            self.children[n] = self._popen(n)

    def _told_of_death(self, name: str) -> list[str]:
        """Who hears that `name` died: every gateway process; the schedulers (a worker's
        death only its own replica's scheduler; a gateway's, so that they end its requests);
        with several replicas the router, of a scheduler's; the detokenizer, of the (only)
        scheduler's."""
        size = self.config.data_parallel.data_parallel_size
        schedulers = [replica_name("scheduler", i, size) for i in range(size)]
        if name.startswith("worker"):
            schedulers = [name.replace("worker", "scheduler", 1)]
        peers = [*self.gateways, *schedulers]
        if size > 1 and name in schedulers:
            peers.append("router")
        if name == "scheduler":  # its sequences get no more tokens: the detokenizer forgets them
            peers.append("detokenizer")
        return [p for p in peers if p != name]

    def _addr(self, name: str) -> str:
        size = self.config.data_parallel.data_parallel_size
        if name == "router":
            return router_addr(self.config)
        if size > 1 and name.startswith("scheduler-"):
            return replica_addrs(self.config, "scheduler")[int(name.rpartition("-")[2])]
        if self._is_gateway(name):
            return gateway_addrs(self.config)[self.gateways.index(name)]
        return self.config.addr(name)

    def _send(self, name: str, frame: bytes) -> None:
        sock = self._peers.get(name)
        if sock is None:
            sock = self._peers[name] = zmq.Context.instance().socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 0)
            addr = self._addr(name)
            if self.curve is not None and uses_curve(addr):
                self.curve.connect(sock)
            sock.connect(addr)
        sock.send(frame, zmq.NOBLOCK)

    def _drain_inbox(self) -> list:
        msgs = []
        while self.inbox.poll(0):
            msgs.append(codec.decode(self.inbox.recv()))
        return msgs

    def drain(self) -> None:
        """SIGTERM: every gateway process refuses new requests and waits for its in-flight
        ones (up to --shutdown-timeout); once all have, everything stops."""
        timeout = self.config.server.shutdown_timeout
        waiting = [g for g in self.gateways if g in self.ready]
        if timeout <= 0 or not waiting:
            return
        drain = codec.encode(Drain(reply_to=self.config.addr("supervisor"), timeout_s=timeout))
        for name in waiting:
            self._send(name, drain)
        deadline = time.monotonic() + timeout + 5.0
        while waiting and time.monotonic() < deadline:
            drained = {m.name for m in self._drain_inbox() if isinstance(m, Drained)}
            # (a gateway that died meanwhile has nothing left to finish)
            waiting = [g for g in waiting if g not in drained and self.children[g].poll() is None]
            time.sleep(0.05)

    def request_stop(self, *_: object) -> None:
        self._stop = True

    def shutdown(self) -> None:
        for sock in self._peers.values():
            sock.close(linger=0)
        for proc in self.children.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + _GRACE_S
        for proc in self.children.values():
            try:
                proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self.inbox.close(linger=0)
        for port in (self.listener, self._grpc_hold):
            if port is not None:
                port.close()


class ChildDied(RuntimeError):
    pass


def _visible_gpus() -> list[str]:
    """The GPUs children may use: CUDA_VISIBLE_DEVICES, else every NVIDIA GPU the driver
    lists (no torch import in the supervisor)."""
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    if env is not None:
        return [g.strip() for g in env.split(",") if g.strip()]
    gpus = Path("/proc/driver/nvidia/gpus")
    return [str(i) for i in range(len(list(gpus.iterdir())))] if gpus.is_dir() else []


def _repo_root() -> str:
    return str(Path(__file__).resolve().parent.parent)


def prepare(config: Config) -> Config:
    """Resolve the model folder (converting the default model once) and the run directory."""
    spec = config.speculative
    if spec.method and is_synthetic_spec(config.model.model):
        raise ConfigError("--speculative needs a real model, not --model synthetic")
    if spec.draft_model and not (Path(spec.draft_model).expanduser() / "config.json").is_file():
        raise ConfigError(
            f"--draft-model {spec.draft_model}: no config.json there (a Hugging Face folder?)"
        )
    load_chat_template(config.server.chat_template)  # a bad one stops here, not in a child
    template = config.server.chat_template
    if template and Path(template).is_file():  # the children may run in another folder
        template = str(Path(template).resolve())
    path = resolve_model_path(config)
    if config.parallel.node_rank != 0:
        raise ConfigError("--node-rank > 0: run `shuttle worker-ranks` on that host instead")
    check_parallel(config, None if is_synthetic_spec(config.model.model) else path)
    run_dir = config.server.run_dir or tempfile.mkdtemp(prefix="shuttle-")
    gateways = _gateway_processes(config)
    return config.replace(
        model={
            "model": str(path),
            "served_model_name": config.model.served_model_name or model_display_name(path),
        },
        server={"run_dir": run_dir, "chat_template": template, "gateway_processes": gateways},
    )


def _gateway_processes(config: Config) -> int:
    """--gateway-processes, 0 resolved: by the cores, but no more than the --gateway-addr
    inboxes given; N given with fewer inboxes is refused here, by name."""
    given = [a for a in config.addresses.gateway_addr.split(",") if a.strip()]
    n = config.server.gateway_processes
    if n == 0:
        n = default_gateway_processes()
        return min(n, len(given)) if given else n
    if given and len(given) < n:
        raise ConfigError(
            f"--gateway-processes {n} needs {n} --gateway-addr inboxes, not {len(given)}"
        )
    return n


def startup_line(msg: Ready | Progress, elapsed_s: float) -> str:
    """What `shuttle serve` prints while it starts: each process's stages and its Ready,
    with the seconds since the start (a model's load is seconds, not silence)."""
    if isinstance(msg, Progress):
        return f"shuttle: [{elapsed_s:5.1f}s] {msg.name}: {msg.stage}"
    return f"shuttle: [{elapsed_s:5.1f}s] {msg.name} ready"


def serve(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="shuttle serve", description="serve a model")
    parser.add_argument(
        "model_tag", nargs="?", default=None, help="the model (as vLLM's `vllm serve MODEL`)"
    )
    add_flags(parser)
    args = parser.parse_args(argv)
    if args.model_tag is not None:  # the positional form of --model
        flagged = args.__dict__.setdefault("model.model", args.model_tag)
        if flagged != args.model_tag:
            parser.error(f"the model is given twice: {args.model_tag!r} and --model {flagged!r}")
    try:
        config = prepare(from_args(args))
    except ConfigError as e:
        parser.error(str(e))
    run_dir = Path(config.server.run_dir)
    created_run_dir = not args.__dict__.get("server.run_dir")
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.json").write_bytes(config.to_json())
    sup = Supervisor(config)
    signal.signal(signal.SIGTERM, sup.request_stop)
    signal.signal(signal.SIGINT, sup.request_stop)
    code = 0
    try:
        sup.start()
        sup.wait_ready()
        print(
            f"shuttle: serving {config.model.served_model_names[0]} on "
            f"http://{sup._client_host()}:{sup.port} (pid {os.getpid()}){sup.grpc_banner()}",
            flush=True,
        )
        sup.supervise()
        sup.drain()
    except KeyboardInterrupt:
        pass
    except (ChildDied, TimeoutError) as e:
        print(f"shuttle: {e}; stopping", file=sys.stderr, flush=True)
        code = 1
    finally:
        sup.shutdown()
        if config.data_parallel.is_disaggregated and not config.data_parallel.kv_transfer_dir:
            shutil.rmtree(kv_transfer_dir(config), ignore_errors=True)  # (hand-overs' files)
        if created_run_dir:
            shutil.rmtree(run_dir, ignore_errors=True)
        else:
            for sock in run_dir.glob("*.sock"):
                sock.unlink(missing_ok=True)
    return code
