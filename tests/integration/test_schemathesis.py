"""A bounded schemathesis run against the gateway's own OpenAPI schema finds no server error
(5xx); afterwards the server still serves and every KV block is free."""

from __future__ import annotations

import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.server import Server, running_server
from tests.tiny_models import make_tiny_model
from tests.waiting import wait_until

# minutes of fuzzing: `make test-slow` (pytest -m slow), not `make test`
pytestmark = pytest.mark.slow

ADMIN = "fuzz-admin"
MAX_EXAMPLES = 25  # per operation in the fuzzing phase: a few minutes on two CPU cores
SEED = 20261129  # the same cases every run, so a CI failure reproduces


def _schemathesis() -> Path:
    exe = Path(sys.executable).parent / "schemathesis"
    if not exe.exists():
        pytest.skip("schemathesis is not installed (pip install -e '.[test]')")
    return exe


@pytest.fixture(scope="module")
def fuzz_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    # A tiny random model (SmolLM2's tokenizer, 2 layers) and a short context: every path
    # through gateway, tokenizer, scheduler and detokenizer is the real one, while a valid
    # generated request costs milliseconds per token and at most a few dozen tokens.
    model = make_tiny_model(tmp_path_factory.mktemp("tiny"), "llama")
    flags = ("--model", str(model), "--max-model-len", "64", "--admin-token", ADMIN)
    with running_server(*flags) as s:
        yield s


def test_the_schema_describes_the_request_bodies(fuzz_server: Server) -> None:
    spec = httpx.get(fuzz_server.url + "/openapi.json", timeout=30).json()
    for path, required in (("/v1/chat/completions", "messages"), ("/v1/completions", "prompt")):
        body = spec["paths"][path]["post"]["requestBody"]["content"]["application/json"]
        assert required in body["schema"]["required"], path
        assert "$ref" not in str(body["schema"])  # inlined: no dangling $defs


@pytest.mark.timeout(540)
def test_schemathesis_finds_no_server_error(fuzz_server: Server, tmp_path: Path) -> None:
    # every route in the schema (admin ones with the token), valid and invalid data
    cmd = [
        str(_schemathesis()),
        "run",
        fuzz_server.url + "/openapi.json",
        "--header",
        f"Authorization: Bearer {ADMIN}",
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
    counts = re.search(r"(\d+) generated, (\d+) passed", out.stdout)
    assert counts and int(counts[1]) == int(counts[2]) >= 200, out.stdout[-3000:]  # it did run


def test_afterwards_it_serves_and_every_block_is_free(fuzz_server: Server) -> None:
    r = httpx.post(
        fuzz_server.url + "/v1/chat/completions",
        json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3},
        timeout=120,
    )
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1, r.text
    headers = {"authorization": f"Bearer {ADMIN}"}

    def settled() -> bool:  # aborts of the last requests may still be on their way
        stats = httpx.get(fuzz_server.url + "/admin/stats", headers=headers, timeout=30).json()
        return stats["num_running"] == 0 and stats["num_used_blocks"] == 0

    wait_until(settled, 60, "nothing running and every block free")
