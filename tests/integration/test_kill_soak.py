"""A bounded soak with kills (tools/soak.py): clients stream back to back while a process of
each kind in turn (worker, scheduler, detokenizer, tokenizer, gateway) is SIGKILLed and
restarted. No request hangs, none fails except with the gateway that held it, at least 80%
of the requests complete with the tokens they asked for, and the processes' resident memory
stays flat. `SHUTTLE_KILL_SOAK_S` sets the duration (default 120 s: one kill of each kind);
`tools/soak --duration 600` runs it longer."""

from __future__ import annotations

import asyncio
import os

import pytest

from tests.server import running_server
from tools.soak import server_flags, soak

DURATION_S = float(os.environ.get("SHUTTLE_KILL_SOAK_S", "120"))
CLIENTS = 16


@pytest.mark.slow  # minutes of load: `pytest -m slow`, not `make test`
def test_soak_with_a_kill_of_every_process_kind() -> None:
    with running_server(*server_flags(CLIENTS), timeout=300) as server:
        report = asyncio.run(soak(server, DURATION_S, CLIENTS, kill_every_s=DURATION_S / 6))
    print(report.summary())
    assert report.num_requests > 2 * CLIENTS, report.summary()
    assert len(report.kills) >= 4, report.summary()
    assert report.verdict(min_completion=0.8) == [], report.summary()
