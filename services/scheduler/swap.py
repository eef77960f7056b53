"""Model hot-swap, as the scheduler runs it.

    overlap:  load the new version beside the old -> new requests start on it -> when no
              request of the old version is left, unload it -> done
    drain:    pause starts -> when no started request is left -> load (replacing the old;
              the KV pool is rebuilt if its layout changed) -> resume -> done

Queued requests never fail: they wait (drain) or start on whichever version is current.
A failed load leaves the old version serving and reports the error.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from typing import Any

from common.messages import (
    LoadModel,
    ModelInfo,
    ModelLoaded,
    SwapModel,
    SwapResult,
    UnloadModel,
)
from services.scheduler.policy import SchedulingPolicy

log = logging.getLogger(__name__)


@dataclasses.dataclass
class _Swap:
    request: SwapModel
    old_version: str
    started: float
    phase: str  # draining | loading | retiring


class SwapCoordinator:
    def __init__(
        self, send_worker: Callable[[Any], None], reply: Callable[[str, SwapResult], None]
    ) -> None:
        self.send_worker = send_worker
        self.reply = reply
        self.swap: _Swap | None = None
        self.num_swaps = 0

    def status(self) -> dict[str, Any] | None:
        if self.swap is None:
            return None
        r = self.swap.request
        return {
            "mode": r.mode,
            "phase": self.swap.phase,
            "from": self.swap.old_version,
            "path": r.path,
            "to": r.version or "(hash of the weights)",
            "elapsed_s": round(time.monotonic() - self.swap.started, 3),
        }

    def start(self, msg: SwapModel, policy: SchedulingPolicy) -> None:
        if self.swap is not None:
            self.reply(
                msg.reply_to,
                SwapResult(
                    ticket=msg.ticket,
                    ok=False,
                    mode=msg.mode,
                    error="a swap is already in progress",
                ),
            )
            return
        self.swap = _Swap(
            msg, policy.version, time.monotonic(), "draining" if msg.mode == "drain" else "loading"
        )
        log.info("swap to %s (%s) started", msg.path, msg.mode)
        if msg.mode == "drain":
            policy.paused = True
            self.advance(policy, in_flight=True)
        else:
            self.send_worker(LoadModel(path=msg.path, version=msg.version, mode="overlap"))

    def advance(self, policy: SchedulingPolicy, in_flight: bool) -> None:
        """Move on when the requests the current phase waits for have finished."""
        s = self.swap
        if s is None:
            return
        if s.phase == "draining" and not in_flight and policy.num_started_on() == 0:
            s.phase = "loading"
            r = s.request
            self.send_worker(LoadModel(path=r.path, version=r.version, mode="drain"))
        elif s.phase == "retiring" and policy.num_started_on(s.old_version) == 0:
            self.send_worker(UnloadModel(version=s.old_version))
            self._done(policy, ok=True)

    def on_loaded(
        self, msg: ModelLoaded, policy: SchedulingPolicy, adopt: Callable[[ModelInfo], None]
    ) -> None:
        """The worker's answer to LoadModel: `adopt` installs the new version's info."""
        s = self.swap
        if s is None:
            log.warning("model loaded with no swap in progress: %s", msg.version)
            return
        if msg.error:
            log.error("swap failed: %s", msg.error)
            if msg.model is not None:  # a failed drain rebuilt the old model on a new pool
                adopt(msg.model)
            self._done(policy, ok=False, error=msg.error)
            return
        if msg.model is None:
            self._done(policy, ok=False, error="the worker described no model")
            return
        adopt(msg.model)
        if s.request.mode == "drain":
            self._done(policy, ok=True)
        else:
            s.phase = "retiring"
            self.advance(policy, in_flight=True)

    def _done(self, policy: SchedulingPolicy, ok: bool, error: str = "") -> None:
        s = self.swap
        assert s is not None
        policy.paused = False
        self.swap = None
        self.num_swaps += ok
        r = s.request
        self.reply(
            r.reply_to,
            SwapResult(
                ticket=r.ticket,
                ok=ok,
                version=policy.version if ok else "",
                previous_version=s.old_version,
                mode=r.mode,
                duration_s=time.monotonic() - s.started,
                error=error,
            ),
        )
        log.info(
            "swap %s: %s -> %s in %.2fs",
            "done" if ok else "failed",
            s.old_version,
            policy.version,
            time.monotonic() - s.started,
        )
