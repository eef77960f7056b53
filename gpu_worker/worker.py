"""The worker process: holds the model and the KV tensors, runs each planned step.

With --tensor-parallel-size N this is rank 0 of a group of N worker processes (one per
device). The scheduler does not know N: rank 0 alone has the ZMQ inbox, and it broadcasts
every message that changes worker state (plans, model loads and unloads, resets, grammar
compiles, shutdown) to ranks 1.. over the group's gloo control group before handling it
itself, so every rank sees the same messages in the same order (gpu_worker/rank.py).
Broadcast, not a ZMQ publish to every rank: ordering across all message types comes free,
nothing on the scheduler's side changes, a late-joining subscriber cannot miss a message,
and a dead rank breaks the collective, which takes the whole group down. Only rank 0
answers the scheduler.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import gc
import logging
import os
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any

from common import codec
from common.actor import Actor
from common.config import Config
from common.ipc import Outbox
from common.messages import (
    CompileGrammar,
    GrammarCompiled,
    LoadLora,
    LoadModel,
    LoraLoaded,
    ModelInfo,
    ModelLoaded,
    Ready,
    Reset,
    Shutdown,
    StepPlan,
    StepResult,
    UnloadLora,
    UnloadModel,
)
from common.model_facts import position_config, tokenizer_fingerprint
from common.model_paths import (
    resolve_model_path,
    served_model_name,
    synthetic_params,
    tokenizer_dir,
)
from common.topology import own_name
from gpu_worker.runner.base import Runner
from gpu_worker.runner.synthetic import SyntheticRunner

if TYPE_CHECKING:  # torch is imported only by a real model's worker
    from gpu_worker.distributed.tensor_parallel import TensorParallel

log = logging.getLogger(__name__)

# what every rank of a tensor-parallel group must see, in rank 0's order
REPLICATED = (
    StepPlan,
    LoadModel,
    UnloadModel,
    LoadLora,
    UnloadLora,
    Reset,
    CompileGrammar,
    Shutdown,
)


class Discard:
    """The scheduler outbox of ranks 1..: they answer nobody."""

    def send(self, msg: object) -> None:
        pass


class WorkerActor(Actor):
    name = "worker"

    def __init__(self, config: Config, rank: int = 0) -> None:
        super().__init__(config)
        self.rank = rank
        self.tp: TensorParallel | None = None  # the group, when there is one (start())
        self.runner: Runner  # built in start()
        self.boot_id = uuid.uuid4().hex
        # grammar compiles running on the runner's thread, not answered yet
        self._compiles: list[tuple[concurrent.futures.Future[None], CompileGrammar]] = []
        self.handlers.update(
            {
                StepPlan: self._on_step_plan,
                LoadModel: self._on_load_model,
                UnloadModel: self._on_unload_model,
                Reset: self._on_reset,
                CompileGrammar: self._on_compile_grammar,
                LoadLora: self._on_load_lora,
                UnloadLora: self._on_unload_lora,
            }
        )

    async def start(self) -> None:
        self.tp = self._join_group()
        path = str(resolve_model_path(self.config))
        self.report_progress(f"loading the model {path}")
        self.runner = self._build(path)
        self.scheduler = self._scheduler_outbox()
        info = self.runner.model_info()
        # (the disk tier's keys are counted, not listed: there may be many)
        shown = dataclasses.replace(info, tier_disk_keys=[], tier_disk_tokens=[])
        log.info("model loaded: %s (%d blocks on disk)", shown, len(info.tier_disk_keys))
        self.report_progress(
            f"model loaded: {info.num_blocks} KV blocks of {info.block_size} tokens "
            f"({info.kv_cache_dtype} KV), {info.dtype} on {info.device}"
        )

    async def stop(self) -> None:
        """The disk tier's queued writes land before the process ends (they outlive it)."""
        runner = getattr(self, "runner", None)  # (None when start-up failed)
        if runner is not None:
            runner.close()

    def _join_group(self) -> TensorParallel | None:
        """Join the tensor-parallel group (blocks until every rank has joined)."""
        parallel = self.config.parallel
        if parallel.tensor_parallel_size == 1:
            return None
        from gpu_worker.distributed.tensor_parallel import join_group

        tp = join_group(
            self.rank,
            parallel.tensor_parallel_size,
            parallel.dist_init_addr,
            self.config.model.device,
            local_rank=self.rank % parallel.ranks_per_node,
        )
        log.info("rank %d of %d joined", tp.rank, tp.size)
        return tp

    def _scheduler_outbox(self) -> Outbox | Discard:
        return self.outbox(self.config.addr("scheduler"))

    def _build(self, path: str) -> Runner:
        if synthetic_params(path) is not None:  # --model synthetic: no compute at all
            return SyntheticRunner.from_config(path, self.config)
        from gpu_worker.runner.model_runner import ModelRunner  # imports torch: only when needed

        return ModelRunner.from_config(path, self.config, self.tp, self.report_progress)

    async def dispatch(self, msg: Any) -> None:
        """Rank 0 of a group hands the message to the other ranks first."""
        if self.tp is not None and self.tp.is_leader and isinstance(msg, REPLICATED):
            self.tp.broadcast_frame(codec.encode(msg))  # a broken group raises: we stop
        await super().dispatch(msg)

    def _stop_if_group_broken(self, e: Exception) -> None:
        """In a group a failed collective (RuntimeError) leaves the ranks out of step: stop
        this rank, so the supervisor restarts the whole group."""
        if self.tp is not None and isinstance(e, RuntimeError):
            log.critical("rank %d stops: %s: %s", self.rank, type(e).__name__, e)
            raise SystemExit(1) from e

    def ready_model(self) -> ModelInfo:
        return self.model_info()

    def model_info(self) -> ModelInfo:
        path = Path(self.runner.model_path)
        return dataclasses.replace(
            self.runner.model_info(),
            model_name=served_model_name(self.config),
            model_path=str(path),  # its tokenizer files, for the tokenizer processes
            tokenizer_fingerprint=tokenizer_fingerprint(path),
            position_config=position_config(path),
            pid=os.getpid(),
            # unique per process start: in a container a restarted worker has pid 1 again
            boot_id=self.boot_id,
        )

    @property
    def inbox_name(self) -> str:
        return own_name(self.config, "worker")  # `worker-<i>` in replica i of several

    def ready_targets(self) -> list[str]:
        return [*super().ready_targets(), self.config.addr("scheduler")]

    def _on_reset(self, msg: Reset) -> None:
        """A new scheduler: forget every request, announce the pool again."""
        self.runner.reset()
        self.scheduler.send(Ready(name=self.name, info={}, model=self.model_info()))

    def _on_load_model(self, msg: LoadModel) -> None:
        """Hot swap: load beside the served versions (overlap) or instead of them (drain)."""
        try:
            if msg.mode == "overlap":
                check_loadable(msg.path)
                version = self.runner.load_version(msg.path, msg.version)
                self.runner.set_default_version(version)
            else:
                self._replace(msg.path, msg.version)
            reply = ModelLoaded(version=self.runner.default_version, model=self.model_info())
        except Exception as e:  # a bad folder, bad weights, a layout mismatch: old one serves
            self._stop_if_group_broken(e)
            log.exception("loading %s failed", msg.path)
            rebuilt = msg.mode != "overlap" and hasattr(self, "runner")
            reply = ModelLoaded(
                version=msg.version,
                error=f"{type(e).__name__}: {e}",
                # a failed drain rebuilt the old model on a new (empty) KV pool: say so
                model=self.model_info() if rebuilt else None,
            )
        self.scheduler.send(reply)

    def _replace(self, path: str, version: str) -> None:
        """Drain mode: only one copy fits, so free the old runner first; if the new one
        cannot be built, rebuild the old one and re-raise."""
        check_loadable(path)  # fail before freeing anything when the folder is unusable
        old_path, old_version = self.runner.model_path, self.runner.default_version
        info = self.runner.model_info()
        loras = list(zip(info.lora_names, info.lora_paths, strict=True))
        self.runner.close()  # (its queued disk writes land before the next one scans)
        del self.runner
        gc.collect()
        try:
            self.runner = self._build(path)
        except Exception:
            self.runner = self._build(old_path)
            self.runner.relabel(old_version)
            self._reload_loras(loras)
            raise
        if version:
            self.runner.relabel(version)
        self._reload_loras(loras)

    def _reload_loras(self, loras: list[tuple[str, str]]) -> None:
        """The adapters the replaced runner held, read again for the new one; one that does
        not fit the new model is logged and left out (ModelLoaded's ModelInfo lists those
        that stay)."""
        for name, path in loras:
            try:
                self.runner.load_lora(name, path)
            except Exception as e:  # LoraAdapterError, or the folder is gone
                log.warning("LoRA adapter %s dropped by the swap: %s", name, e)

    def _on_unload_model(self, msg: UnloadModel) -> None:
        try:
            self.runner.unload_version(msg.version)
            gc.collect()
        except (KeyError, ValueError) as e:
            log.warning("cannot unload %s: %s", msg.version, e)

    def _on_load_lora(self, msg: LoadLora) -> None:
        """Read an adapter into the runner's cache; the answer carries its weights hash and
        rank, or the error naming the file and field (nothing is loaded then)."""
        try:
            spec = self.runner.load_lora(msg.name, msg.path)
            reply = LoraLoaded(msg.name, weights_hash=spec.weights_hash, rank=spec.rank)
        except Exception as e:  # a bad folder is the client's error: the worker serves on
            self._stop_if_group_broken(e)
            log.warning("LoRA adapter %s from %s refused: %s", msg.name, msg.path, e)
            reply = LoraLoaded(msg.name, error=f"{type(e).__name__}: {e}")
        self.scheduler.send(reply)

    def _on_unload_lora(self, msg: UnloadLora) -> None:
        try:
            self.runner.unload_lora(msg.name)
        except KeyError as e:
            log.warning("cannot unload LoRA adapter %s: %s", msg.name, e)

    def _on_compile_grammar(self, msg: CompileGrammar) -> None:
        """Compile on the runner's background thread; answer from this loop's thread (the
        socket is not thread-safe) when done. Steps keep running meanwhile, and each step
        answers the compiles done by then: while plans keep coming, the loop runs handlers
        back to back and a callback scheduled on it would wait until the queue empties (the
        constrained requests held that long behind the others)."""
        loop = asyncio.get_running_loop()
        future = self.runner.compile_grammar(msg.kind, msg.spec, msg.tokenizer_fingerprint)
        self._compiles.append((future, msg))

        def done(_: concurrent.futures.Future[None]) -> None:  # an idle worker: wake the loop
            if not loop.is_closed():
                loop.call_soon_threadsafe(self._answer_compiles)

        future.add_done_callback(done)

    def _answer_compiles(self) -> None:
        """GrammarCompiled for each compile that has finished and is not answered yet."""
        finished = [(f, m) for f, m in self._compiles if f.done()]
        if not finished:
            return
        self._compiles = [(f, m) for f, m in self._compiles if not f.done()]
        for future, msg in finished:
            error = (
                "the worker is stopping" if future.cancelled() else str(future.exception() or "")
            )
            self.scheduler.send(GrammarCompiled(msg.request_id, error, msg.tokenizer_fingerprint))

    def _on_step_plan(self, plan: StepPlan) -> None:
        try:
            result = self.runner.execute(plan, self.scheduler.send)
        except Exception as e:
            # A failed step must not wedge the scheduler: it fails that step's requests.
            self._stop_if_group_broken(e)
            log.exception("step %d failed", plan.step_id, extra={"step_id": plan.step_id})
            for req_id in plan.req_ids:
                self.runner.drop(req_id)
            result = StepResult(
                step_id=plan.step_id,
                req_ids=[],
                token_ids=[],
                # its tier reads are not known to have landed: the scheduler forgets them
                tier_fetch_failed_keys=plan.tier_fetch_keys,
                kv_import_failed_dst=plan.kv_import_dst,  # (nor its hand-over's imports)
                error=f"{type(e).__name__}: {e}",
            )
        self.scheduler.send(result)
        self._answer_compiles()


def check_loadable(path: str) -> None:
    """Fail a model swap before anything changes when the folder (or GGUF file) at `path` is
    unusable: no readable config.json (a GGUF file's: it names a tensor of a type we do not
    serve), or a tokenizer that cannot be loaded (the tokenizer processes load
    it to serve the new version, so a model without one must not replace a working one)."""
    from transformers import AutoTokenizer

    from gpu_worker.model_loader.hf_folder import read_hf_config

    read_hf_config(path)
    try:
        AutoTokenizer.from_pretrained(tokenizer_dir(path))
    except Exception as e:  # transformers raises OSError, ValueError, KeyError... by cause
        reason = (str(e).strip().splitlines() or [""])[0]  # its messages run to many lines
        raise ValueError(
            f"{path}: its tokenizer cannot be loaded ({type(e).__name__}: {reason})"
        ) from e
