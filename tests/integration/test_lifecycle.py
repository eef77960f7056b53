"""`shuttle serve` starts every process, and stopping it leaves no process and no ipc file."""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

import httpx

from tests.server import running_server
from tests.waiting import wait_until


def _children(pid: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout
    return [int(x) for x in out.split()]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie is dead for our purposes
    stat = Path(f"/proc/{pid}/stat")
    return stat.exists() and stat.read_text().split()[2] != "Z"


def _wait_gone(pids: list[int]) -> None:
    wait_until(lambda: not [p for p in pids if _alive(p)], 60, f"processes {pids} to exit")


def test_sigterm_stops_every_process_and_removes_sockets() -> None:
    with running_server("--num-tokenizers", "2", "--gateway-processes", "2") as server:
        kids = _children(server.proc.pid)
        assert len(kids) == 7  # worker, scheduler, detokenizer, 2 tokenizers, 2 gateways
        socks = sorted(p.name for p in server.run_dir.glob("*.sock"))
        assert socks == sorted(
            [
                "worker.sock",
                "scheduler.sock",
                "detokenizer.sock",
                "tokenizer-0.sock",
                "tokenizer-1.sock",
                "gateway-0.sock",
                "gateway-1.sock",
                "supervisor.sock",
            ]
        )
        assert httpx.get(server.url + "/health").status_code == 200
        server.proc.send_signal(signal.SIGTERM)
        assert server.proc.wait(30) == 0
        _wait_gone(kids)
        assert list(server.run_dir.glob("*.sock")) == []


def test_children_die_with_a_killed_supervisor() -> None:
    with running_server("--gateway-processes", "1") as server:
        kids = _children(server.proc.pid)
        assert len(kids) == 5  # worker, scheduler, detokenizer, tokenizer, gateway
        server.proc.send_signal(signal.SIGKILL)
        server.proc.wait(10)
        _wait_gone(kids)


def test_a_child_that_keeps_dying_stops_the_whole_server() -> None:
    with running_server("--max-restarts", "1") as server:
        kids = _children(server.proc.pid)
        detok = next(
            p
            for p in kids
            if "services.detokenizer" in Path(f"/proc/{p}/cmdline").read_text().replace("\0", " ")
        )
        os.kill(detok, signal.SIGKILL)  # restarted once
        again = wait_until(
            lambda: [p for p in _children(server.proc.pid) if p not in kids],
            60,
            "the detokenizer to be restarted",
        )
        os.kill(again[0], signal.SIGKILL)  # a second time within a minute: give up
        assert server.proc.wait(30) == 1
        _wait_gone(kids + again)


def _free_ports(n: int) -> list[int]:
    import socket

    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def test_single_host_over_tcp_with_curve(tmp_path: Path) -> None:
    """`shuttle serve` with every inbox on tcp:// and --curve-dir: all links, the
    supervisor's included (Ready reports, drain), are CURVE; it starts, serves and stops."""
    import sys

    keys = tmp_path / "keys"
    subprocess.run(
        [sys.executable, "-m", "common.curve", "keygen", str(keys)],
        check=True,
        cwd=Path(__file__).resolve().parents[2],
    )
    ports = _free_ports(6)
    names = ["gateway", "scheduler", "worker", "detokenizer", "supervisor"]
    flags = [
        f
        for name, port in zip(names, ports, strict=False)
        for f in (f"--{name}-addr", f"tcp://127.0.0.1:{port}")
    ]
    flags += ["--tokenizer-addrs", f"tcp://127.0.0.1:{ports[5]}", "--curve-dir", str(keys)]
    with running_server(*flags) as server:
        r = httpx.post(
            server.url + "/v1/completions",
            timeout=120,
            json={"model": server.model, "prompt": "Hello", "max_tokens": 3},
        )
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
        server.proc.send_signal(signal.SIGTERM)
        assert server.proc.wait(60) == 0
