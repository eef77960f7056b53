"""Data parallelism's config section (common/parallel_config.py) refuses bad settings."""

from __future__ import annotations

from typing import Any

import pytest

from common.config import Config, ConfigError


@pytest.mark.parametrize(
    "bad",
    [
        {"data_parallel_size": 0},
        {"dp_routing": "random"},
        {"dp_load_bound": 0.5},
        {"replica_index": 2, "data_parallel_size": 2},
    ],
)
def test_bad_settings_fail_at_start_up(bad: dict[str, Any]) -> None:
    with pytest.raises(ConfigError):
        Config().replace(data_parallel=bad)
