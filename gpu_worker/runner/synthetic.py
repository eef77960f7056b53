"""The synthetic model: a worker runner with no compute, to measure the pipeline itself.

    shuttle serve --model synthetic
    shuttle serve --model synthetic:delay_ms=20,num_blocks=4096,words=64

`--model synthetic[:key=value,...]` resolves to a folder beside the default model's
(`<cache>/models/synthetic[-key-value...]`) holding the default model's tokenizer files
(symlinks) and its config.json plus a `shuttle_synthetic` entry with the parameters. The
tokenizer and detokenizer processes read that folder as any other; the worker sees the entry
and builds a `SyntheticRunner` instead of a `ModelRunner`.

The runner follows the StepPlan diff semantics of common/messages/scheduler_worker.py exactly
(they are gpu_worker/runner/request_table.py's `RequestTable`, shared with ModelRunner: the real
scheduler drives it unchanged, and a plan that disagrees with its state is refused the same way),
but computes nothing: a request that reaches the end of its known tokens
"samples" at once a deterministic token, a function of its prompt and position drawn from a
cycle of ordinary word tokens (" the", " and", ...), so detokenisation costs what it costs
on real text. Parameters:

    delay_ms     sleep this long per step (0): a stand-in for a model's step time
    num_blocks   KV blocks reported to the scheduler (65536; no memory is held)
    words        how many distinct word tokens the outputs cycle through (256)
    eos_after    emit EOS as the n-th output token (0: never; ignore_eos skips it)
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import json
import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from common.config import Config, ConfigError
from common.lora_config import LoraConfig
from common.messages.scheduler_worker import StepPlan, StepResult
from common.messages.types import ModelInfo
from common.model_paths import synthetic_params
from gpu_worker.lora.adapter import AdapterSpec, LoraAdapterError, ModelShape
from gpu_worker.lora.registry import LoadedAdapterSpecs, load_start_modules
from gpu_worker.runner.base import PlanRunner
from gpu_worker.runner.request_table import RequestState, RequestTable
from gpu_worker.runner.version_table import VersionTable

_FLOOR = -9999.0  # OpenAI's floor for a logprob (gpu_worker/sample/logprobs.py's MIN_LOGPROB)
_WORD = re.compile(r"^Ġ[a-z]{3,9}$")  # byte-level BPE: "Ġ" is a leading space


def word_token_ids(tokenizer_json: Path, count: int) -> list[int]:
    """The `count` lowest ids of plain lowercase words with a leading space (common words)."""
    vocab = json.loads(tokenizer_json.read_text())["model"]["vocab"]
    ids = sorted(i for token, i in vocab.items() if _WORD.match(token))
    return ids[:count] or [int(i) for i in sorted(vocab.values())[:count]]


class SyntheticRunner(PlanRunner[str]):
    """A `Runner` (gpu_worker/runner/base.py) without a model: the shared plan rules, no
    KV, and a deterministic "sampled" token. Its versions map a label to the folder."""

    def __init__(
        self,
        model_path: str,
        *,
        block_size: int = 16,
        dtype: str = "float32",
        max_model_len: int | None = None,
        lora: LoraConfig | None = None,
    ) -> None:
        params = synthetic_params(model_path)
        if params is None:
            raise ValueError(f"{model_path} is not a synthetic model folder")
        self.model_path = model_path
        self.params = params
        self.config = json.loads((Path(model_path) / "config.json").read_text())
        self.block_size = block_size
        self.dtype = dtype
        self.num_blocks = int(params["num_blocks"])
        limit = int(self.config.get("max_position_embeddings", 8192))
        self.max_model_len = min(limit, max_model_len) if max_model_len else limit
        self.words = word_token_ids(Path(model_path) / "tokenizer.json", int(params["words"]))
        eos = self.config.get("eos_token_id", 2)
        self.eos_token_ids = [eos] if isinstance(eos, int) else list(eos)
        digest = hashlib.sha256(json.dumps(params, sort_keys=True).encode()).hexdigest()
        self.versions = VersionTable("synthetic-" + digest[:8], model_path)
        self.delay_s = float(params["delay_ms"]) / 1e3
        self.eos_after = int(params["eos_after"])
        # LoRA adapters: their folders read and checked for real, no weights kept
        self.loras = LoadedAdapterSpecs(lora, ModelShape.from_hf(self.config)) if lora else None
        self.requests = RequestTable(
            block_size=block_size,
            num_blocks=self.num_blocks,
            max_model_len=self.max_model_len,
            loras=self.loras,
        )
        load_start_modules(self.load_lora, lora.modules if lora else ())

    def compile_grammar(
        self, kind: str, spec: str, tokenizer_fingerprint: str
    ) -> concurrent.futures.Future[None]:
        """No sampling, so no grammar: structured outputs are refused."""
        future: concurrent.futures.Future[None] = concurrent.futures.Future()
        future.set_exception(ValueError("structured outputs need a real model, not synthetic"))
        return future

    @classmethod
    def from_config(cls, model_path: str, config: Config) -> SyntheticRunner:
        """The runner the worker serves a synthetic folder with, from the config."""
        if config.speculative.method:
            raise ConfigError("--speculative needs a real model, not --model synthetic")
        m = config.model
        return cls(
            model_path,
            block_size=config.cache.block_size,
            dtype=m.dtype,
            max_model_len=m.max_model_len or None,
            lora=config.lora if config.lora.enable_lora else None,
        )

    def model_info(self) -> ModelInfo:
        c = self.config
        heads = c.get("num_attention_heads", 1)
        return ModelInfo(
            model_type="synthetic",
            num_layers=c.get("num_hidden_layers", 1),
            num_kv_heads=c.get("num_key_value_heads") or heads,
            head_dim=c.get("head_dim") or c.get("hidden_size", 64) // heads,
            dtype=self.dtype,
            num_blocks=self.num_blocks,
            block_size=self.block_size,
            max_model_len=self.max_model_len,
            vocab_size=c.get("vocab_size", 0),
            eos_token_ids=list(self.eos_token_ids),
            weights_version=self.default_version,
            num_host_blocks=0,
            device="none",
            **(self.loras.model_info_fields() if self.loras else {}),
        )

    def load_lora(self, name: str, path: str) -> AdapterSpec:
        """Check the adapter folder against the model's config (no tensor is read)."""
        if self.loras is None:
            raise LoraAdapterError(f"{path}: LoRA is not enabled (--enable-lora)")
        spec = self.loras.check(name, path)
        self.loras.add(spec)
        return spec

    def unload_lora(self, name: str) -> None:
        if self.loras is None:
            raise KeyError(f"LoRA adapter {name!r} is not loaded (LoRA is not enabled)")
        self.loras.remove(name)

    # hot swap: a synthetic model serves one version (relabelled, never joined by another);
    # a drain-mode swap replaces the runner
    def load_version(self, path: str, version: str = "") -> str:
        raise ValueError("the synthetic model cannot load a version beside itself")

    def unload_version(self, version: str) -> None:
        raise ValueError(f"version {version!r} is the synthetic model's only one")

    def execute(self, plan: StepPlan, report: Callable[[Any], None] | None = None) -> StepResult:
        """Apply the diffs, check the batch against them, "sample" at once."""
        start = time.perf_counter()
        states = self._begin_step(plan)
        req_ids: list[str] = []
        token_ids: list[int] = []
        sampled: list[RequestState] = []
        for rid, state in zip(plan.req_ids, states, strict=True):
            if state.needs_sample:
                token_ids.append(self._token(state))
                req_ids.append(rid)
                sampled.append(state)
                state.token_ids.append(token_ids[-1])
        pooled = [state for state in states if state.is_pooled]  # embeddings: a vector each
        if self.delay_s:
            time.sleep(self.delay_s)
        return StepResult(
            step_id=plan.step_id,
            req_ids=req_ids,
            token_ids=token_ids,
            **self._logprobs(sampled, token_ids),
            pooled_req_ids=[state.req_id for state in pooled],
            embeddings=[_embedding(state.token_ids) for state in pooled],
            forward_s=time.perf_counter() - start,
        )

    def _logprobs(self, states: list[RequestState], tokens: list[int]) -> dict[str, Any]:
        """StepResult's logprob lists, as a model certain of its every output token would
        give them: 0 for it, the floor for the other words of the top k; a prompt token's
        prediction (the first word) is as certain."""
        out: dict[str, Any] = {}
        if any(s.params.logprobs is not None for s in states):
            pairs = zip(states, tokens, strict=True)
            entries = [self._entry(t, s.params.logprobs, t) for s, t in pairs]
            out["logprob_token_ids"] = [ids for ids, _ in entries]
            out["logprob_values"] = [values for _, values in entries]
        asking = [
            s.params.prompt_logprobs is not None and not s.prompt_logprobs_sent for s in states
        ]
        if any(asking):
            pairs = zip(states, asking, strict=True)
            prompts = [self._prompt(s) if a else ([], []) for s, a in pairs]
            out["prompt_logprob_token_ids"] = [ids for ids, _ in prompts]
            out["prompt_logprob_values"] = [values for _, values in prompts]
        return out

    def _entry(self, token: int, k: int | None, sure: int) -> tuple[list[int], list[float]]:
        """[token, top 1..k] and their logprobs when the model is certain of `sure`."""
        if k is None:
            return [], []
        top = [sure, *[w for w in self.words[: k + 1] if w != sure]][:k]
        values = [0.0 if t == sure else _FLOOR for t in top]
        return [token, *top], [0.0 if token == sure else _FLOOR, *values]

    def _prompt(self, state: RequestState) -> tuple[list[list[int]], list[list[float]]]:
        state.prompt_logprobs_sent = True
        prompt, k = state.token_ids[: state.num_prompt], state.params.prompt_logprobs
        rest = [self._entry(t, k, self.words[0]) for t in prompt[1:]]
        return [[prompt[0]], *[ids for ids, _ in rest]], [[], *[v for _, v in rest]]

    def _token(self, state: RequestState) -> int:
        """A function of the prompt and the position in the output."""
        n = len(state.token_ids) - state.num_prompt  # outputs so far
        if self.eos_after and n + 1 == self.eos_after:
            return self.eos_token_ids[0]
        key = sum(state.token_ids[: min(64, state.num_prompt)]) + state.num_prompt
        return self.words[(key + n) % len(self.words)]


def _embedding(prompt: list[int]) -> list[float]:
    """An embeddings request's "pooled" vector: a function of its prompt (8 numbers)."""
    key = sum(prompt) + len(prompt)
    return [float((key + 3 * j) % 11 - 5) for j in range(8)]
