"""The one shape of every process entry: name it, die with the parent, build, run, report."""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import logging
import signal
import sys
from collections.abc import Callable, Coroutine
from typing import Any

from common.actor import Actor
from common.config import Config, ConfigError, add_flags, from_args
from common.log import setup_logging

log = logging.getLogger(__name__)


def _die_with_parent() -> None:
    """Linux: get SIGTERM when the supervisor dies, so no process is ever orphaned."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def _set_title(title: str) -> None:
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(15, ctypes.c_char_p(title.encode()[:15]), 0, 0, 0)  # PR_SET_NAME
    except OSError:
        pass


def run_actor(
    name: str,
    build: Callable[[Config, argparse.Namespace], Actor],
    argv: list[str] | None = None,
    extra_flags: Callable[[argparse.ArgumentParser], None] | None = None,
    instance: Callable[[Config, argparse.Namespace], str] | None = None,
) -> int:
    """Run the actor `build` makes; `instance` names this process among several of its
    kind (`gateway-1`) in its title and log lines, else `name` does."""
    parser = argparse.ArgumentParser(prog=f"python -m services.{name}")
    add_flags(parser)
    if extra_flags is not None:
        extra_flags(parser)
    args = parser.parse_args(argv)
    try:
        config = from_args(args)
    except ConfigError as e:
        parser.error(str(e))
    _die_with_parent()
    label = name if instance is None else instance(config, args)
    _set_title(f"shuttle-{label}")
    setup_logging(label, config.server.log_level)
    try:
        actor = build(config, args)
        _run(actor.run())
    except Exception:
        log.exception("%s crashed", name)
        return 1
    return 0


def _run(coro: Coroutine[Any, Any, None]) -> None:
    try:
        import uvloop

        uvloop.run(coro)
    except ImportError:
        asyncio.run(coro)


if __name__ == "__main__":  # pragma: no cover
    sys.exit("run a service module instead")
