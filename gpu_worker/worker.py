"""The worker process: holds the model and the KV tensors, runs each planned step."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

from common.actor import Actor
from common.config import Config, ConfigError
from common.messages import StepPlan, StepResult
from common.model_facts import position_config, tokenizer_fingerprint

log = logging.getLogger(__name__)


def resolve_model_path(config: Config) -> Path:
    """The configured folder, or the default model (converted on first use)."""
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
        self.handlers[StepPlan] = self._on_step_plan

    async def start(self) -> None:
        from gpu_worker.model_runner import ModelRunner

        m, c = self.config.model, self.config.cache
        self.runner = ModelRunner(
            str(resolve_model_path(self.config)),
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
        )
        self.scheduler = self.outbox(self.config.addr("scheduler"))
        log.info("model loaded: %s", self.runner.model_info())

    def ready_info(self) -> dict[str, Any]:
        info = dict(self.runner.model_info())
        path = resolve_model_path(self.config)
        info["model_name"] = served_model_name(self.config)
        info["tokenizer_fingerprint"] = tokenizer_fingerprint(path)
        info["position_config"] = position_config(path)
        info["pid"] = os.getpid()
        return info

    def ready_targets(self) -> list[str]:
        return [*super().ready_targets(), self.config.addr("scheduler")]

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
