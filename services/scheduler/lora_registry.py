"""The LoRA adapters a scheduler serves, and how they load and unload.

    load:    LoadLoraAdapter (gateway) -> LoadLora (worker) -> LoraLoaded -> ready,
             LoraAdapterResult 200 (or 400 naming the worker's file and field)
    unload:  UnloadLoraAdapter -> unloading: new requests for it get 404 at once, requests
             already accepted finish (vLLM lets them finish too) -> no live request of it
             -> its cached blocks are dropped, UnloadLora (worker) -> LoraAdapterResult 200
    swap:    a new base model drops the adapters whose base_model_name it does not match
             (they unload as above; their requests that have not started fail, saying so)
    restart: a new worker knows no adapter: every one is loaded again (503 meanwhile)

The start-up adapters (--lora-modules) load as soon as the worker is ready. Whoever depends
on the set (the gateway: /v1/models, which `model` names exist) hears LorasChanged after
every change; nobody polls. No sockets here: messages leave through callables.
"""

from __future__ import annotations

import dataclasses
import logging
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

from common.config import Config
from common.lora_config import LoraModule
from common.messages import (
    LoadLora,
    LoadLoraAdapter,
    LoraAdapterResult,
    LoraLoaded,
    LorasChanged,
    ModelInfo,
    TokenizedRequest,
    UnloadLora,
    UnloadLoraAdapter,
)

log = logging.getLogger(__name__)

Refusal = tuple[int, str, str | None]  # (HTTP status, message naming the field, the field)


@dataclasses.dataclass
class Adapter:
    module: LoraModule
    state: str = "loading"  # loading | ready | unloading
    weights_hash: str = ""
    rank: int = 0
    num_requests: int = 0  # requests accepted for it in all
    # who waits for the answer: (ticket, reply_to) of a load, then of unloads
    load_waiter: tuple[int, str] | None = None
    unload_waiters: list[tuple[int, str]] = dataclasses.field(default_factory=list)

    @property
    def name(self) -> str:
        return self.module.name


class ServedAdapters:
    """The adapters of one replica; see the module docstring."""

    def __init__(
        self,
        config: Config,
        send_worker: Callable[[LoadLora | UnloadLora], None],
        reply: Callable[[str, LoraAdapterResult], None],
        push: Callable[[LorasChanged], None],
    ) -> None:
        self.enabled = config.lora.enable_lora
        # a draft model has no adapters; n-gram drafts are verified with the request's adapter
        self.has_draft_model = config.speculative.method == "draft"
        self.replica = config.data_parallel.replica_index
        self.send_worker, self.reply, self.push = send_worker, reply, push
        self.adapters: dict[str, Adapter] = {}
        for module in config.lora.modules if self.enabled else []:
            self.adapters[module.name] = Adapter(module)
        self.base_names: set[str] = set(config.model.served_model_names)

    @property
    def has_unloading(self) -> bool:
        return any(a.state == "unloading" for a in self.adapters.values())

    @property
    def is_settled(self) -> bool:
        """No adapter is loading (the start-up ones are in, or refused)."""
        return all(a.state != "loading" for a in self.adapters.values())

    def weights_hashes(self) -> dict[str, str]:
        """The adapters ready now, name -> weights hash, by name (what the router hears)."""
        return {n: self.adapters[n].weights_hash for n in self.names()}

    def names(self, state: str = "ready") -> list[str]:
        return sorted(n for n, a in self.adapters.items() if a.state == state)

    # the worker ----------------------------------------------------------------------------
    def on_worker_ready(self, info: ModelInfo) -> None:
        """A (new) worker holds the adapters its ModelInfo lists (the start-up ones, which
        it loads itself): they are served; every other one we serve is loaded again, and
        unloads in progress are done (the worker forgot them anyway)."""
        self.base_names |= _model_names(info)
        self.enabled = self.enabled or bool(info.max_loras)  # (an in-process runner's)
        held = zip(
            info.lora_names, info.lora_paths, info.lora_weights_hashes, info.lora_ranks, strict=True
        )
        for name, path, weights_hash, rank in held:
            a = self.adapters.setdefault(name, Adapter(LoraModule(name, path)))
            if a.state == "unloading":  # (no request of it is left: the restart failed them)
                self.send_worker(UnloadLora(name=name))
                self._unloaded(a)
            else:
                a.state, a.weights_hash, a.rank = "ready", weights_hash, rank
        for a in list(self.adapters.values()):
            if a.name in info.lora_names:
                continue
            if a.state == "unloading":
                self._unloaded(a)
                continue
            a.state = "loading"
            self.send_worker(LoadLora(name=a.name, path=a.module.path))
        self._drop_mismatched()
        self.changed()

    def on_loaded(self, msg: LoraLoaded) -> None:
        a = self.adapters.get(msg.name)
        if a is None or a.state != "loading":
            return  # unloaded (or dropped) while it loaded: the unload follows it
        if msg.error:
            log.error("LoRA adapter %s refused: %s", msg.name, msg.error)
            del self.adapters[msg.name]
            result = LoraAdapterResult(0, a.name, 400, msg.error)
        else:
            a.state, a.weights_hash, a.rank = "ready", msg.weights_hash, msg.rank
            log.info("LoRA adapter %s loaded (rank %d, %s)", a.name, a.rank, a.weights_hash)
            result = LoraAdapterResult(0, a.name, 200, weights_hash=a.weights_hash, rank=a.rank)
        self.changed()  # (before the answer: a client may name the adapter at once)
        self._answer(a.load_waiter, result)
        a.load_waiter = None

    # the gateway ---------------------------------------------------------------------------
    def load(self, msg: LoadLoraAdapter) -> None:
        refusal = self._load_refusal(msg)
        if refusal is not None:
            self.reply(msg.reply_to, LoraAdapterResult(msg.ticket, msg.name, *refusal))
            return
        module = LoraModule(msg.name, msg.path, msg.base_model_name)
        self.adapters[msg.name] = Adapter(module, load_waiter=(msg.ticket, msg.reply_to))
        self.send_worker(LoadLora(name=msg.name, path=msg.path))

    def _load_refusal(self, msg: LoadLoraAdapter) -> tuple[int, str] | None:
        if not self.enabled:
            return 400, "LoRA adapters are not enabled on this server (--enable-lora)"
        if msg.name in self.base_names:
            return 400, f"lora_name: `{msg.name}` is the base model's name"
        a = self.adapters.get(msg.name)
        if a is not None:  # (vLLM's answer to a name loaded twice)
            what = {"ready": "has already been loaded", "loading": "is being loaded"}
            why = what.get(a.state, "is being unloaded")
            return 400, f"lora_name: the lora adapter '{msg.name}' {why}"
        if msg.base_model_name and msg.base_model_name not in self.base_names:
            return 400, (
                f"base_model_name: the adapter is for `{msg.base_model_name}`; this server "
                f"serves {sorted(self.base_names)}"
            )
        return None

    def unload(self, msg: UnloadLoraAdapter, num_live: Counter[str]) -> None:
        a = self.adapters.get(msg.name)
        if a is None or a.state == "loading":
            status = 404 if a is None else 409
            why = "cannot be found" if a is None else "is still being loaded"
            error = f"lora_name: the lora adapter '{msg.name}' {why}"
            self.reply(msg.reply_to, LoraAdapterResult(msg.ticket, msg.name, status, error))
            return
        a.unload_waiters.append((msg.ticket, msg.reply_to))
        if a.state == "ready":
            a.state = "unloading"
            log.info("LoRA adapter %s unloading (%d live requests)", a.name, num_live[a.name])
            self.changed()
        self.advance(num_live)

    def on_model_swapped(self, info: ModelInfo) -> list[str]:
        """A hot swap serves `info` now: adapters made for another base model unload, and
        so do those the worker's ModelInfo no longer lists (they do not fit the new model).
        Returns their names (their requests that have not started fail)."""
        self.base_names = _model_names(info)
        held = set(info.lora_names) if info.max_loras else None
        return self._drop_mismatched(held)

    def _drop_mismatched(self, held: set[str] | None = None) -> list[str]:
        """Unload the adapters whose base_model_name the served model does not answer to,
        and the ready ones missing from `held` (None: the worker did not say)."""
        dropped = [
            a.name
            for a in self.adapters.values()
            if a.state != "unloading"
            and (
                (a.module.base_model_name and a.module.base_model_name not in self.base_names)
                or (held is not None and a.state == "ready" and a.name not in held)
            )
        ]
        for name in dropped:
            log.warning("LoRA adapter %s dropped: its base model is not the one served", name)
            self.adapters[name].state = "unloading"
        if dropped:
            self.changed()
        return dropped

    # requests ------------------------------------------------------------------------------
    def check(self, msg: TokenizedRequest) -> Refusal | Adapter:
        """The adapter a request names, or why it cannot run."""
        name = msg.lora_name
        a = self.adapters.get(name) if self.enabled else None
        if a is None or a.state == "unloading":
            return 404, f"model: the model `{name}` does not exist", "model"
        if self.has_draft_model:
            return (
                400,
                f"model: `{name}` is a LoRA adapter, which this server does not serve with "
                "a draft model (--draft-model; --speculative ngram serves adapters); ask for "
                "the base model",
                "model",
            )
        if a.state == "loading":
            return 503, f"model: the adapter `{name}` is being loaded; retry shortly", "model"
        a.num_requests += 1
        return a

    def handover_refusal(self, name: str, weights_hash: str) -> str:
        """Why a decode replica cannot continue a sequence a prefill replica ran with the
        adapter `name` of `weights_hash` ("": it can, or the base model ran it): its KV is
        that adapter's, and its next tokens must be too."""
        if not name:
            return ""
        a = self.adapters.get(name) if self.enabled else None
        if a is None or a.state != "ready":
            state = "" if a is None else f" ({a.state})"
            return f"the decode replica does not serve the LoRA adapter `{name}`{state}"
        if self.has_draft_model:
            return f"the decode replica runs a draft model, which serves no LoRA adapter `{name}`"
        if a.weights_hash != weights_hash:
            return (
                f"the decode replica serves the LoRA adapter `{name}` with other weights "
                f"({a.weights_hash}) than the prefill replica ({weights_hash})"
            )
        return ""

    def advance(self, num_live: Counter[str], drop_blocks: Callable[[str], int] = len) -> None:
        """Finish the unloads whose adapter no live request uses any more."""
        for a in list(self.adapters.values()):
            if a.state == "unloading" and not num_live[a.name]:
                num_dropped = drop_blocks(a.name)
                log.info("LoRA adapter %s unloaded (%d cached blocks dropped)", a.name, num_dropped)
                self.send_worker(UnloadLora(name=a.name))
                self._unloaded(a)

    def _unloaded(self, a: Adapter) -> None:
        del self.adapters[a.name]
        for waiter in a.unload_waiters:
            self._answer(waiter, LoraAdapterResult(0, a.name, 200))
        self.changed()

    def changed(self) -> None:
        ready = [self.adapters[n] for n in self.names()]
        self.push(
            LorasChanged(
                replica=self.replica,
                names=[a.name for a in ready],
                paths=[a.module.path for a in ready],
            )
        )

    def _answer(self, waiter: tuple[int, str] | None, result: LoraAdapterResult) -> None:
        if waiter is not None:
            self.reply(waiter[1], dataclasses.replace(result, ticket=waiter[0]))

    def stats(self, num_live: Counter[str], num_blocks: Counter[str]) -> dict[str, Any]:
        """/admin/stats' `lora_adapters`: per adapter its state, rank, weights hash, requests
        accepted, requests live, prefix-cache blocks it owns."""
        return {
            name: {
                "state": a.state,
                "path": a.module.path,
                "rank": a.rank,
                "weights_hash": a.weights_hash,
                "num_requests": a.num_requests,
                "num_live_requests": num_live[name],
                "num_cached_blocks": num_blocks[name],
            }
            for name, a in sorted(self.adapters.items())
        }


def _model_names(info: ModelInfo) -> set[str]:
    """The names an adapter's base_model_name may give the served model."""
    return {
        n for n in (info.model_name, Path(info.model_path).name if info.model_path else "") if n
    }
