"""A bounded schemathesis run against the gateway's own OpenAPI schema finds no server error
(5xx); afterwards the server still serves and every KV block is free."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.server import Server, running_server

ADMIN = "fuzz-admin"
MAX_EXAMPLES = 30  # per operation and phase: a few minutes on two CPU cores
SEED = 20261129  # the same cases every run, so a CI failure reproduces


def _schemathesis() -> Path:
    exe = Path(sys.executable).parent / "schemathesis"
    if not exe.exists():
        pytest.skip("schemathesis is not installed (pip install -e '.[test]')")
    return exe


@pytest.fixture(scope="module")
def fuzz_server() -> Iterator[Server]:
    # a short context bounds what a valid generated request can cost (its output tokens)
    with running_server("--admin-token", ADMIN, "--max-model-len", "128") as s:
        yield s


def test_the_schema_describes_the_request_bodies(fuzz_server: Server) -> None:
    spec = httpx.get(fuzz_server.url + "/openapi.json", timeout=30).json()
    for path, required in (("/v1/chat/completions", "messages"), ("/v1/completions", "prompt")):
        body = spec["paths"][path]["post"]["requestBody"]["content"]["application/json"]
        assert required in body["schema"]["required"], path
        assert "$ref" not in str(body["schema"])  # inlined: no dangling $defs


@pytest.mark.timeout(540)
def test_schemathesis_finds_no_server_error(fuzz_server: Server, tmp_path: Path) -> None:
    # every route in the schema, valid and invalid data; admin routes without the token
    cmd = [
        str(_schemathesis()),
        "run",
        fuzz_server.url + "/openapi.json",
        "--checks",
        "not_a_server_error",
        "--phases",
        "examples,coverage,fuzzing",
        "--max-examples",
        str(MAX_EXAMPLES),
        "--seed",
        str(SEED),
        "--workers",
        "1",
        "--request-timeout",
        "120",
        "--generation-database",
        "none",
        "--no-color",
        "--report",
        "junit",
        "--report-dir",
        str(tmp_path),
    ]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=500, cwd=tmp_path)
    assert out.returncode == 0, out.stdout[-6000:] + out.stderr[-2000:]
    assert "not_a_server_error" in out.stdout  # the check ran


def test_afterwards_it_serves_and_every_block_is_free(fuzz_server: Server) -> None:
    r = httpx.post(
        fuzz_server.url + "/v1/chat/completions",
        json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3},
        timeout=120,
    )
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1, r.text
    headers = {"authorization": f"Bearer {ADMIN}"}
    for _ in range(100):  # aborts of the last requests may still be on their way
        stats = httpx.get(fuzz_server.url + "/admin/stats", headers=headers, timeout=30).json()
        if stats["num_running"] == 0 and stats["num_used_blocks"] == 0:
            break
        time.sleep(0.1)
    assert stats["num_running"] == 0 and stats["num_used_blocks"] == 0, stats
