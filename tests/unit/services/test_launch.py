"""What `shuttle serve` prints while it starts (services/launch.py startup_line)."""

from __future__ import annotations

from common.messages import Progress, Ready
from services.launch import startup_line


def test_each_stage_and_each_ready_is_a_line_with_the_time_since_the_start() -> None:
    stage = Progress(name="worker", stage="loading weights from /m, building kernels")
    assert startup_line(stage, 1.25) == (
        "shuttle: [  1.2s] worker: loading weights from /m, building kernels"
    )
    assert startup_line(Ready(name="gateway", info={"port": 1}), 6.0) == (
        "shuttle: [  6.0s] gateway ready"
    )
