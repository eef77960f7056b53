"""Start a real `shuttle serve` (all processes) on an ephemeral port, and always clean it up."""

from __future__ import annotations

import ctypes
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx

from tests.waiting import wait_until

REPO = Path(__file__).resolve().parent.parent
_SERVING = re.compile(r"serving (\S+) on (http://\S+)(?:.* grpc (\S+))?")


class Server:
    def __init__(
        self,
        proc: subprocess.Popen[str],
        url: str,
        model: str,
        run_dir: Path,
        log_path: Path,
        grpc_addr: str | None = None,
    ) -> None:
        self.proc = proc
        self.url = url
        self.grpc_addr = grpc_addr  # "HOST:PORT" when started with --grpc-port
        self.model = model
        self.run_dir = run_dir
        self.log_path = log_path

    @property
    def base_url(self) -> str:
        return self.url + "/v1"

    def client(self, timeout: float = 120.0) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=timeout)

    def logs(self) -> str:
        return self.log_path.read_text(errors="replace")

    def serves(self) -> bool:
        """Whether a short completion succeeds right now (a restart over, say)."""
        try:
            r = httpx.post(
                self.url + "/v1/completions",
                timeout=30,
                json={"model": self.model, "prompt": "Hello", "max_tokens": 2},
            )
        except httpx.HTTPError:
            return False
        return r.status_code == 200

    def children(self) -> list[tuple[str, int]]:
        """(module, pid) of each process the supervisor runs: gpu_worker, services.gateway,
        services.tokenizer (one per tokenizer), ..."""
        kids = subprocess.run(
            ["pgrep", "-P", str(self.proc.pid)], capture_output=True, text=True
        ).stdout.split()
        out = []
        for pid in kids:
            try:
                argv = Path(f"/proc/{pid}/cmdline").read_text().split("\0")
            except OSError:
                continue  # exited meanwhile
            module = next((a for a in argv if a.startswith("services.") or a == "gpu_worker"), None)
            if module is not None:
                out.append((module, int(pid)))
        return out

    def gateway_pids(self) -> dict[int, int]:
        """The pid of each gateway process, by its --index (0 when it has none)."""
        pids = {}
        for module, pid in self.children():
            if module != "services.gateway":
                continue
            try:
                argv = Path(f"/proc/{pid}/cmdline").read_text().split("\0")
            except OSError:
                continue  # exited meanwhile
            index = argv[argv.index("--index") + 1] if "--index" in argv else "0"
            pids[int(index)] = pid
        return pids


@contextmanager
def running_server(*flags: str, timeout: float = 300.0) -> Iterator[Server]:
    """`shuttle serve --port 0 FLAGS...`; yields once it answers, stops it on exit."""
    tmp = Path(tempfile.mkdtemp(prefix="shuttle-test-"))
    run_dir = tmp / "run"
    log_path = tmp / "server.log"
    cmd = [
        sys.executable,
        "-m",
        "services.cli",
        "serve",
        "--port",
        "0",
        "--run-dir",
        str(run_dir),
        "--kv-cache-memory",
        "0.5",
        *flags,
    ]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    log_file = log_path.open("w")
    proc = subprocess.Popen(
        cmd,
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=log_file,
        text=True,
        env=env,
        start_new_session=True,
        preexec_fn=_die_with_parent,
    )
    found: list[tuple[str, str, str | None]] = []
    reader = threading.Thread(target=_read_banner, args=(proc, found), daemon=True)
    reader.start()
    try:
        try:
            wait_until(lambda: found or proc.poll() is not None, timeout, "the serving banner")
            if not found:
                raise AssertionError(f"it exited with {proc.returncode}")
        except AssertionError as e:
            raise RuntimeError(
                f"server did not start ({e}):\n" + log_path.read_text(errors="replace")[-4000:]
            ) from None
        model, url, grpc_addr = found[0]
        yield Server(proc, url, model, run_dir, log_path, grpc_addr)
    finally:
        _stop(proc)
        log_file.close()


def _die_with_parent() -> None:
    """If the test process is killed outright, its server goes too (Linux PDEATHSIG)."""
    ctypes.CDLL("libc.so.6").prctl(1, signal.SIGTERM)


def _read_banner(proc: subprocess.Popen[str], found: list[tuple[str, str, str | None]]) -> None:
    assert proc.stdout is not None
    for line in proc.stdout:
        m = _SERVING.search(line)
        if m and not found:
            found.append((m.group(1), m.group(2), m.group(3)))


def _stop(proc: subprocess.Popen[str]) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            pass
    # whatever is left in the session (children included) goes
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()
