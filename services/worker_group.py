"""The worker's tensor-parallel ranks as one unit of supervision, and `shuttle worker-ranks`.

With --tensor-parallel-size N the worker is N processes (one per device) forming one
torch.distributed group. Rank 0 is the `worker` the scheduler talks to; ranks 1.. are named
`worker-rank-R`. They live and die together: when any rank exits the supervisor kills the
others, tells the gateway and the scheduler the worker is down (its requests in flight end
with the retryable 503 and their blocks are freed, as for a single worker) and starts the
whole group again, on a fresh rendezvous port when it picked the port itself.

One host (the default):

    shuttle serve --tensor-parallel-size 2            # ranks 0, 1 here; loopback rendezvous

Several hosts: every host runs N / nnodes ranks; rank 0's host runs everything else too.

    host A: shuttle serve --tensor-parallel-size 4 --nnodes 2 --node-rank 0 \\
                --dist-init-addr A:29500 --model /models/m
    host B: shuttle worker-ranks --tensor-parallel-size 4 --nnodes 2 --node-rank 1 \\
                --dist-init-addr A:29500 --model /models/m           # ranks 2, 3

`shuttle worker-ranks` starts and restarts its host's ranks (each one is
`python -m gpu_worker --config-file RUN/config.json --rank R --dist-init-addr A:29500`,
which can also be run by hand or by another process manager). When the group breaks,
host B's ranks exit (their broadcast fails), this command starts them again and they meet
the new rank 0 at the same address.
"""

from __future__ import annotations

import argparse
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common.config import Config, ConfigError, add_flags, from_args
from common.model_paths import is_synthetic_spec, resolve_model_path

# (the names are common/topology.py's, which the console's process list also uses)
from common.topology import WORKER as WORKER
from common.topology import is_worker_rank as is_worker_rank
from common.topology import worker_rank_name as rank_name


def free_loopback_addr() -> str:
    """127.0.0.1:PORT with a port free right now (rank 0's TCP store binds it next)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


def rank_specs(config: Config, cfg_args: list[str]) -> list[tuple[str, list[str]]]:
    """(name, command) of each worker rank this host runs, on a rendezvous address chosen
    now: --dist-init-addr, or a free loopback port."""
    base = [sys.executable, "-m", "gpu_worker", *cfg_args]
    parallel = config.parallel
    if parallel.tensor_parallel_size == 1:
        return [(WORKER, base)]
    addr = parallel.dist_init_addr or free_loopback_addr()
    return [
        (rank_name(r), [*base, "--rank", str(r), "--dist-init-addr", addr])
        for r in parallel.local_ranks
    ]


def check_parallel(config: Config, model_path: Path | None) -> None:
    """Refuse, before any process starts, a group the model cannot be split over."""
    size = config.parallel.tensor_parallel_size
    if size == 1:
        return
    if config.data_parallel.data_parallel_size > 1:  # one worker per replica, for now
        raise ConfigError(
            "--tensor-parallel-size > 1 with --data-parallel-size > 1 is not supported yet: "
            "use one of them"
        )
    if model_path is None or is_synthetic_spec(config.model.model):
        raise ConfigError("--tensor-parallel-size > 1 needs a real model, not --model synthetic")
    from common.model_paths import hf_config_of
    from gpu_worker.distributed.sharding import check_divisible

    hf = hf_config_of(model_path)  # a folder's config.json, or a GGUF file's
    heads = hf["num_attention_heads"]
    try:
        check_divisible(
            size,
            num_heads=heads,
            num_kv_heads=hf.get("num_key_value_heads") or heads,
            intermediate_size=hf["intermediate_size"],
            model=str(model_path),
        )
    except ValueError as e:
        raise ConfigError(str(e)) from None


def worker_ranks(argv: list[str] | None = None) -> int:
    """`shuttle worker-ranks`: run this host's ranks of a group whose rank 0 is elsewhere."""
    parser = argparse.ArgumentParser(
        prog="shuttle worker-ranks",
        description="run this host's tensor-parallel worker ranks (hosts other than rank 0's)",
    )
    add_flags(parser)
    try:
        config = from_args(parser.parse_args(argv))
        if config.parallel.nnodes < 2 or config.parallel.node_rank < 1:
            raise ConfigError("worker-ranks is for --nnodes >= 2 and --node-rank >= 1")
        path = resolve_model_path(config)
        check_parallel(config, path)
    except ConfigError as e:
        parser.error(str(e))
    run_dir = Path(config.server.run_dir or tempfile.mkdtemp(prefix="shuttle-ranks-"))
    run_dir.mkdir(parents=True, exist_ok=True)
    config = config.replace(model={"model": str(path)}, server={"run_dir": str(run_dir)})
    (run_dir / "config.json").write_bytes(config.to_json())
    return _keep_running(config, ["--config-file", str(run_dir / "config.json")])


def _keep_running(config: Config, cfg_args: list[str]) -> int:
    stop: list[int] = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
    signal.signal(signal.SIGINT, lambda *_: stop.append(1))
    restarts: list[float] = []
    while not stop:
        procs = [subprocess.Popen(cmd) for _, cmd in rank_specs(config, cfg_args)]
        while not stop and all(p.poll() is None for p in procs):
            time.sleep(0.2)
        stop_all(procs, signal.SIGTERM if stop else signal.SIGKILL)
        now = time.monotonic()
        restarts = [t for t in restarts if now - t < 60.0] + [now]
        if not stop and len(restarts) > config.server.max_restarts:
            print("shuttle: worker ranks keep dying; giving up", file=sys.stderr, flush=True)
            return 1
    return 0


def stop_all(procs: list[subprocess.Popen[bytes]], sig: int = signal.SIGKILL) -> None:
    """Signal every process still running, then reap them all."""
    for proc in procs:
        if proc.poll() is None:
            proc.send_signal(sig)
    for proc in procs:
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
