"""The synthetic model: a worker runner with no compute, to measure the pipeline itself.

    shuttle serve --model synthetic
    shuttle serve --model synthetic:delay_ms=20,num_blocks=4096,words=64

`--model synthetic[:key=value,...]` resolves to a folder beside the default model's
(`<cache>/models/synthetic[-key-value...]`) holding the default model's tokenizer files
(symlinks) and its config.json plus a `shuttle_synthetic` entry with the parameters. The
tokenizer and detokenizer processes read that folder as any other; the worker sees the entry
and builds a `SyntheticRunner` instead of a `ModelRunner`.

The runner follows the StepPlan diff semantics of common/messages/scheduler_worker.py exactly
(the real scheduler drives it unchanged, and a plan that disagrees with its state is refused
the same way), but computes nothing: a request that reaches the end of its known tokens
"samples" at once a deterministic token, a function of its prompt and position drawn from a
cycle of ordinary word tokens (" the", " and", ...), so detokenisation costs what it costs
on real text. Parameters:

    delay_ms     sleep this long per step (0): a stand-in for a model's step time
    num_blocks   KV blocks reported to the scheduler (65536; no memory is held)
    words        how many distinct word tokens the outputs cycle through (256)
    eos_after    emit EOS as the n-th output token (0: never; ignore_eos skips it)
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

from common.config import ConfigError
from common.messages.scheduler_worker import StepPlan, StepResult
from common.messages.types import SamplingParams

PREFIX = "synthetic"
MARKER = "shuttle_synthetic"
DEFAULTS: dict[str, float] = {"delay_ms": 0.0, "num_blocks": 65536, "words": 256,
                              "eos_after": 0}
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
                    "generation_config.json", "special_tokens_map.json")
_WORD = re.compile(r"^Ġ[a-z]{3,9}$")  # byte-level BPE: "Ġ" is a leading space


def is_synthetic_spec(model: str) -> bool:
    """`--model synthetic` or `--model synthetic:k=v,...`."""
    return model == PREFIX or model.startswith(PREFIX + ":")


def parse_spec(model: str) -> dict[str, float]:
    """The parameters of a `synthetic:k=v,...` spec, defaults filled in; ConfigError if bad."""
    params = dict(DEFAULTS)
    _, _, rest = model.partition(":")
    for item in filter(None, rest.split(",")):
        key, sep, value = item.partition("=")
        if not sep or key not in DEFAULTS:
            raise ConfigError(f"--model {model}: expected key=value with key in {sorted(DEFAULTS)}")
        try:
            params[key] = float(value)
        except ValueError:
            raise ConfigError(f"--model {model}: {key}={value} is not a number") from None
        if params[key] < 0:
            raise ConfigError(f"--model {model}: {key} must be >= 0")
    if params["num_blocks"] < 1 or params["words"] < 1:
        raise ConfigError(f"--model {model}: num_blocks and words must be >= 1")
    return params


def prepare_synthetic_folder(model: str, tokenizer_dir: Path | None = None) -> Path:
    """The folder a `synthetic...` spec serves from, created once beside the default model."""
    from gpu_worker.prepare_model import cache_root, prepare_default_model

    params = parse_spec(model)
    source = tokenizer_dir or prepare_default_model()
    changed = [f"{k}-{params[k]:g}" for k in sorted(params) if params[k] != DEFAULTS[k]]
    folder = cache_root() / "models" / "-".join([PREFIX, *changed])
    config = json.loads((source / "config.json").read_text())
    config[MARKER] = {**params, "tokenizer_dir": str(source)}
    if (folder / "config.json").is_file():
        if json.loads((folder / "config.json").read_text()).get(MARKER) == config[MARKER]:
            return folder
    folder.parent.mkdir(parents=True, exist_ok=True)
    # built aside and renamed: concurrent starts never see half a folder
    tmp = Path(tempfile.mkdtemp(prefix=folder.name + ".", dir=folder.parent))
    try:
        for name in _TOKENIZER_FILES:
            if (source / name).is_file():
                os.symlink((source / name).resolve(), tmp / name)
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        shutil.rmtree(folder, ignore_errors=True)
        os.replace(tmp, folder)
    except OSError:
        if not (folder / "config.json").is_file():  # a concurrent start did not win the race
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return folder


def synthetic_params(folder: str | Path) -> dict[str, Any] | None:
    """The parameters if `folder` is a synthetic model's, else None."""
    path = Path(folder) / "config.json"
    if not path.is_file():
        return None
    return json.loads(path.read_text()).get(MARKER)


def word_token_ids(tokenizer_json: Path, count: int) -> list[int]:
    """The `count` lowest ids of plain lowercase words with a leading space (common words)."""
    vocab = json.loads(tokenizer_json.read_text())["model"]["vocab"]
    ids = sorted(i for token, i in vocab.items() if _WORD.match(token))
    return ids[:count] or [int(i) for i in sorted(vocab.values())[:count]]


@dataclasses.dataclass
class _State:
    num_tokens: int  # prompt + sampled so far
    key: int  # per-request offset into the word cycle (from the prompt)
    num_prompt: int
    params: SamplingParams
    num_blocks: int = 0  # length of its block table
    num_computed: int = 0
    version: str = ""


class SyntheticRunner:
    """ModelRunner's interface (execute, drop, model_info, versions) without a model."""

    def __init__(self, model_path: str, *, block_size: int = 16, dtype: str = "float32",
                 max_model_len: int | None = None, **_: Any) -> None:
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
        self.default_version = self.weights_version = "synthetic-" + digest[:8]
        self.versions: dict[str, str] = {self.default_version: model_path}
        self.delay_s = float(params["delay_ms"]) / 1e3
        self.eos_after = int(params["eos_after"])
        self._requests: dict[str, _State] = {}

    def model_info(self) -> dict[str, Any]:
        c = self.config
        heads = c.get("num_attention_heads", 1)
        return {
            "model_type": "synthetic",
            "num_layers": c.get("num_hidden_layers", 1),
            "num_kv_heads": c.get("num_key_value_heads") or heads,
            "head_dim": c.get("head_dim") or c.get("hidden_size", 64) // heads,
            "dtype": self.dtype,
            "num_blocks": self.num_blocks,
            "block_size": self.block_size,
            "max_model_len": self.max_model_len,
            "vocab_size": c.get("vocab_size", 0),
            "eos_token_ids": list(self.eos_token_ids),
            "weights_version": self.weights_version,
            "num_host_blocks": 0,
            "device": "none",
        }

    # hot swap: a synthetic model serves one version; a drain-mode swap replaces the runner
    def load_version(self, path: str, version: str = "") -> str:
        raise ValueError("the synthetic model cannot load a version beside itself")

    def set_default_version(self, version: str) -> None:
        self.versions = {version: self.model_path}
        self.default_version = self.weights_version = version

    def unload_version(self, version: str) -> None:
        raise ValueError(f"version {version!r} is the synthetic model's only one")

    def num_requests(self) -> int:
        return len(self._requests)

    def drop(self, req_id: str) -> None:
        self._requests.pop(req_id, None)

    def execute(self, plan: StepPlan) -> StepResult:
        """Apply the diffs, check the batch against them, "sample" at once."""
        start = time.perf_counter()
        self._apply_diffs(plan)
        if len({len(plan.req_ids), len(plan.num_computed_tokens), len(plan.num_new_tokens),
                len(plan.new_block_ids)}) != 1:
            raise ValueError(f"step {plan.step_id}: batch fields differ in length")
        states = [self._schedule(plan, i) for i in range(len(plan.req_ids))]
        req_ids: list[str] = []
        token_ids: list[int] = []
        for rid, state in zip(plan.req_ids, states, strict=True):
            if state.num_computed == state.num_tokens:
                token_ids.append(self._token(state))
                req_ids.append(rid)
                state.num_tokens += 1
        if self.delay_s:
            time.sleep(self.delay_s)
        return StepResult(step_id=plan.step_id, req_ids=req_ids, token_ids=token_ids,
                          forward_s=time.perf_counter() - start)

    def _token(self, state: _State) -> int:
        n = state.num_tokens - state.num_prompt  # outputs so far
        if self.eos_after and n + 1 == self.eos_after:
            return self.eos_token_ids[0]
        return self.words[(state.key + n) % len(self.words)]

    def _apply_diffs(self, plan: StepPlan) -> None:
        for rid in plan.finished_req_ids:
            self._requests.pop(rid, None)
        for rid in plan.preempted_req_ids:
            state = self._requests[rid]
            state.num_blocks = state.num_computed = 0
        versions = plan.new_versions or [""] * len(plan.new_req_ids)
        new = zip(plan.new_req_ids, plan.new_prompt_token_ids, plan.new_sampling, versions,
                  strict=True)
        for rid, prompt, params, version in new:
            if rid in self._requests:
                raise ValueError(f"request {rid} is already running on the worker")
            if not prompt:
                raise ValueError(f"request {rid} has an empty prompt")
            key = sum(prompt[:64]) + len(prompt)
            self._requests[rid] = _State(len(prompt), key, len(prompt), params,
                                         version=version or self.default_version)
        for rid in plan.copy_req_ids:
            if rid not in self._requests:
                raise ValueError(f"copy-on-write for unknown request {rid}")

    def _schedule(self, plan: StepPlan, i: int) -> _State:
        """The same checks as ModelRunner._schedule, on counts alone."""
        rid = plan.req_ids[i]
        state = self._requests.get(rid)
        if state is None:
            raise ValueError(f"step {plan.step_id}: unknown request {rid}")
        num_computed, num_new = plan.num_computed_tokens[i], plan.num_new_tokens[i]
        if not state.num_blocks and num_computed <= state.num_tokens:
            state.num_computed = num_computed  # prefix hits, a fork or a swap-in
        if num_computed != state.num_computed:
            raise ValueError(f"request {rid}: plan says {num_computed} tokens computed, "
                             f"worker has {state.num_computed}")
        end = num_computed + num_new
        if num_new < 1 or end > state.num_tokens or end > self.max_model_len:
            raise ValueError(f"request {rid}: cannot compute tokens [{num_computed}, {end}) of "
                             f"{state.num_tokens} known (max_model_len {self.max_model_len})")
        blocks = plan.new_block_ids[i]
        if any(not 0 <= b < self.num_blocks for b in blocks):
            raise ValueError(f"request {rid}: block ids outside [0, {self.num_blocks})")
        state.num_blocks += len(blocks)
        if state.num_blocks * self.block_size < end:
            raise ValueError(f"request {rid}: {state.num_blocks} blocks cannot hold {end} tokens")
        state.num_computed = end
        return state
