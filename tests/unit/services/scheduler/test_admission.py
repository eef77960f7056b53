"""Admission (services/scheduler/admission.py) on the real policy: a waiting request starts
only when its blocks fit."""

from __future__ import annotations

from services.scheduler.request import Status
from tests.unit.services.scheduler.test_policy import _req, _run_step, _sched


def test_admission_waits_for_free_blocks() -> None:
    s = _sched(num_blocks=4, block_size=4, budget=64)
    s.add(_req("a", 12))
    s.add(_req("b", 8))
    assert set(_run_step(s)) == {"a"}  # b's 2 blocks do not fit beside a's 3
    assert s.requests["b"].status == Status.WAITING
