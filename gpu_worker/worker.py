"""The worker process: holds the model and the KV tensors, runs each planned step."""

from __future__ import annotations

import gc
import logging
import os
import uuid
from pathlib import Path
from typing import Any

from common.actor import Actor
from common.config import Config, ConfigError
from common.messages import (
    LoadModel,
    ModelLoaded,
    Ready,
    Reset,
    StepPlan,
    StepResult,
    UnloadModel,
)
from common.model_facts import position_config, tokenizer_fingerprint
from gpu_worker.synthetic import (
    SyntheticRunner,
    is_synthetic_spec,
    prepare_synthetic_folder,
    synthetic_params,
)

log = logging.getLogger(__name__)


def resolve_model_path(config: Config) -> Path:
    """The configured folder, or the default model (converted on first use)."""
    if is_synthetic_spec(config.model.model):  # the default model's tokenizer, no weights
        return prepare_synthetic_folder(config.model.model)
    if config.model.model:
        path = Path(config.model.model).expanduser()
        if not (path / "config.json").is_file():
            raise ConfigError(f"--model {path}: no config.json there (a Hugging Face folder?)")
        return path
    from gpu_worker.prepare_model import prepare_default_model

    return prepare_default_model()


def served_model_name(config: Config) -> str:
    return config.model.served_model_name or resolve_model_path(config).name


class WorkerActor(Actor):
    name = "worker"

    def __init__(self, config: Config) -> None:
        super().__init__(config)
        self.runner: Any = None
        self.boot_id = uuid.uuid4().hex
        self.handlers.update({StepPlan: self._on_step_plan, LoadModel: self._on_load_model,
                              UnloadModel: self._on_unload_model, Reset: self._on_reset})

    async def start(self) -> None:
        self.runner = self._build(str(resolve_model_path(self.config)))
        self.scheduler = self.outbox(self.config.addr("scheduler"))
        log.info("model loaded: %s", self.runner.model_info())

    def _build(self, path: str) -> Any:
        from gpu_worker.model_runner import ModelRunner

        m, c, spec = self.config.model, self.config.cache, self.config.speculative
        if synthetic_params(path) is not None:  # --model synthetic: no compute at all
            if spec.method:
                raise ConfigError("--speculative needs a real model, not --model synthetic")
            return SyntheticRunner(path, block_size=c.block_size, dtype=m.dtype,
                                   max_model_len=m.max_model_len or None)
        return ModelRunner(
            path,
            dtype=m.dtype,
            device=m.device,
            block_size=c.block_size,
            kv_cache_memory_gib=c.kv_cache_memory,
            max_model_len=m.max_model_len or None,
            seed=m.seed,
            attention_backend=m.attention_backend,
            enforce_eager=m.enforce_eager or None,
            max_graph_batch_size=m.max_graph_batch_size,
            num_threads=m.num_threads or None,
            swap_space_gib=(c.swap_space if self.config.scheduler.preemption_mode == "swap"
                            else 0.0),
            speculative=spec.method,
            draft_model=str(Path(spec.draft_model).expanduser()) if spec.draft_model else "",
            prompt_lookup_min=spec.prompt_lookup_min,
            prompt_lookup_max=spec.prompt_lookup_max,
        )

    def ready_info(self) -> dict[str, Any]:
        return self.model_info()

    def model_info(self) -> dict[str, Any]:
        info = dict(self.runner.model_info())
        path = Path(self.runner.model_path)
        info["model_name"] = served_model_name(self.config)
        info["tokenizer_fingerprint"] = tokenizer_fingerprint(path)
        info["position_config"] = position_config(path)
        info["pid"] = os.getpid()
        # unique per process start: in a container a restarted worker has the same pid (1)
        info["boot_id"] = self.boot_id
        return info

    def ready_targets(self) -> list[str]:
        return [*super().ready_targets(), self.config.addr("scheduler")]

    def _on_reset(self, msg: Reset) -> None:
        """A new scheduler: forget every request, announce the pool again."""
        for req_id in list(self.runner._requests):
            self.runner.drop(req_id)
        self.scheduler.send(Ready(name=self.name, info=self.model_info()))

    def _on_load_model(self, msg: LoadModel) -> None:
        """Hot swap: load beside the served versions (overlap) or instead of them (drain)."""
        try:
            if msg.mode == "overlap":
                version = self.runner.load_version(msg.path, msg.version)
                self.runner.set_default_version(version)
            else:
                self._replace(msg.path, msg.version)
            reply = ModelLoaded(version=self.runner.default_version, info=self.model_info())
        except Exception as e:  # a bad folder, bad weights, a layout mismatch: old one serves
            log.exception("loading %s failed", msg.path)
            reply = ModelLoaded(version=msg.version, info={}, error=f"{type(e).__name__}: {e}")
        self.scheduler.send(reply)

    def _replace(self, path: str, version: str) -> None:
        """Drain mode: only one copy fits, so free the old runner first; if the new one
        cannot be built, rebuild the old one and re-raise."""
        from gpu_worker.models.loader import read_hf_config

        read_hf_config(path)  # fail before freeing anything when the folder is unusable
        old_path, old_version = self.runner.model_path, self.runner.default_version
        self.runner = None
        gc.collect()
        try:
            self.runner = self._build(path)
        except Exception:
            self.runner = self._build(old_path)
            _relabel(self.runner, old_version)
            raise
        if version:
            _relabel(self.runner, version)

    def _on_unload_model(self, msg: UnloadModel) -> None:
        try:
            self.runner.unload_version(msg.version)
            gc.collect()
        except (KeyError, ValueError) as e:
            log.warning("cannot unload %s: %s", msg.version, e)

    def _on_step_plan(self, plan: StepPlan) -> None:
        try:
            result = self.runner.execute(plan)
        except Exception as e:
            # A failed step must not wedge the scheduler: it fails that step's requests.
            log.exception("step %d failed", plan.step_id, extra={"step_id": plan.step_id})
            for req_id in plan.req_ids:
                self.runner.drop(req_id)
            result = StepResult(
                step_id=plan.step_id, req_ids=[], token_ids=[], error=f"{type(e).__name__}: {e}"
            )
        self.scheduler.send(result)


def _relabel(runner: Any, version: str) -> None:
    """Give the runner's only model version an operator-chosen label."""
    old = runner.default_version
    if version != old:
        runner.versions[version] = runner.versions.pop(old)
        runner.set_default_version(version)
