"""What every config section is built from: the error a bad value raises, the field helper
(a default and the flag's help) and the check that names the flag. Its own module so that
sections outside common/config.py (common/parallel_config.py, common/speculative_config.py,
common/lora_config.py) need not import the tree that holds them."""

from __future__ import annotations

import dataclasses
from typing import Any


class ConfigError(ValueError):
    """A config value that cannot be served: raised at start-up, naming the flag."""


def config_field(default: Any, help: str) -> Any:
    """A config field with its default and its flag's help text."""
    return dataclasses.field(default=default, metadata={"help": help})


def check_field(ok: bool, name: str, expected: str) -> None:
    """Raise a ConfigError naming the flag of field `name` unless `ok`."""
    if not ok:
        raise ConfigError(f"--{name.replace('_', '-')} must be {expected}")
