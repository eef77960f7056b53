"""The model runner: the real `Runner` (gpu_worker/runner.py). It runs the model and samples.

The per-request state and the StepPlan rules are the shared `RequestTable`'s; this runner
hands it its KV cache for the plan's copies and adds what needs a model. A step:

    drop finished -> swap out -> reset preempted -> add new -> swap in -> copy-on-write ->
    check each scheduled request and append its new blocks (RequestTable) ->
    compute token_ids[num_computed : num_computed + num_new] for each, and for those that
    reach the end of their tokens sample one token (or verify drafts) and append it;
    logprobs for the requests that ask (gpu_worker/logprobs.py).

The batch is reordered internally so single-token decodes come first (the attention backend
runs them as one batch); results go back in the plan's order.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import itertools
import logging
import os
import random
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import xgrammar

from common.config import Config
from common.messages.scheduler_worker import StepPlan, StepResult
from common.messages.types import ModelInfo, SamplingParams
from common.model_facts import tokenizer_fingerprint
from gpu_worker.attention import (
    AttentionBackend,
    AttentionMetadata,
    build_metadata,
    create_backend,
    resolve_backend_name,
)
from gpu_worker.cpu.huge_pages import use_huge_pages
from gpu_worker.cuda_graphs import CUDAGraphRunner, maybe_capture_graphs, run_model
from gpu_worker.kernel_choice import choose_kernels
from gpu_worker.kv_cache import GIB, KVCache, bytes_per_block, cuda_kv_budget_bytes
from gpu_worker.logits_controls import History, TokenCounts
from gpu_worker.logprobs import (
    PromptEntries,
    add_prompt_entries,
    output_entries,
    prompt_positions,
    step_result_fields,
    take_prompt_logprobs,
)
from gpu_worker.lora.adapter import AdapterSpec, LoraAdapterError
from gpu_worker.lora.manager import LoraManager, model_shape
from gpu_worker.lora.registry import LoraOptions, load_start_modules
from gpu_worker.models.linear import quantization_of, resident_weight_bytes
from gpu_worker.models.llama import LlamaConfig, LlamaForCausalLM
from gpu_worker.models.loader import (
    check_tensor_parallel,
    eos_token_ids,
    load_model,
    read_hf_config,
    stores_quantized,
    weights_version,
)
from gpu_worker.runner import PlanRunner, RequestState, RequestTable
from gpu_worker.sampling import make_generator, sample
from gpu_worker.sharding import threads_per_rank
from gpu_worker.speculative import DraftModel, ngram_propose, verify
from gpu_worker.structured import GrammarCache, RowGrammar, apply_grammars, hf_tokenizer_info
from gpu_worker.tensor_parallel import TensorParallel

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclasses.dataclass
class ModelVersion:
    """One loaded set of weights; several can share the KV pool when their layout matches."""

    model: LlamaForCausalLM
    graphs: CUDAGraphRunner | None
    config: LlamaConfig
    path: str
    eos_token_ids: list[int]
    counts: TokenCounts  # its requests' token counts, for penalties


class IncompatibleModel(ValueError):
    """The new model's KV layout differs from the pool's (swap it in drain mode)."""


@dataclasses.dataclass
class _Batch:
    """One step's model inputs (decodes first) and who samples, in plan order."""

    input_ids: torch.Tensor  # [T]
    meta: AttentionMetadata
    logits_indices: torch.Tensor  # [L] packed indices whose logits are needed
    sampling_req_ids: list[str]  # [S]
    sampling_states: list[RequestState]  # [S]
    drafts: list[list[int]]  # [S] proposed tokens ([] without speculation); request j's
    # logits rows follow those of requests < j, 1 + len(drafts[j]) of them
    draft_probs: list[torch.Tensor | None]  # [S] the draft model's q rows, sampled requests
    spec_slots: list[int]  # [S] draft slots the plan gave it (0: not speculating)
    draft_computed: list[int]  # [S] the draft pool's count after proposing
    # prompt logprobs: the logits rows after the sampling ones are these requests' prompt
    # positions, request after request
    prompt_rows: list[tuple[RequestState, range]] = dataclasses.field(default_factory=list)
    # [R] (plan index, tokens) of each request in packed order (LoRA: each token's adapter)
    packed: list[tuple[int, int]] = dataclasses.field(default_factory=list)

    @property
    def num_sampling_rows(self) -> int:
        return len(self.sampling_states) + sum(len(d) for d in self.drafts)


def kv_budget_bytes(
    device: torch.device, memory_gib: float, gpu_memory_utilization: float, share: float = 1.0
) -> int:
    """`share` of the KV budget: on CUDA, `gpu_memory_utilization` of the memory still free
    once the weights are loaded; elsewhere `memory_gib`."""
    if device.type == "cuda":
        return int(cuda_kv_budget_bytes(device, gpu_memory_utilization) * share)
    return int(memory_gib * GIB * share)


def rank_device_and_threads(config: Config, tp: TensorParallel) -> tuple[str, int | None]:
    """This rank's device (cuda:LOCAL_RANK under tensor parallelism on CUDA) and torch
    threads: --num-threads, else with several ranks on a host each takes cores / ranks."""
    device, threads = config.model.device, config.model.num_threads or None
    if tp.size == 1:
        return device, threads
    per_host = config.parallel.ranks_per_node
    if device == "cuda":
        device = f"cuda:{tp.rank % per_host}"
    if threads is None:
        threads = threads_per_rank(len(os.sched_getaffinity(0)), per_host)
    return device, threads


class ModelRunner(PlanRunner[ModelVersion]):
    """Owns the weights, the KV cache and every request's worker-side state: a `Runner`
    (gpu_worker.runner) whose plan rules are the shared `RequestTable`'s; this class adds the
    KV copies, the forward passes, sampling and speculative decoding."""

    def __init__(
        self,
        model_path: str,
        *,
        dtype: str = "float32",
        device: str = "cpu",
        block_size: int = 16,
        kv_cache_memory_gib: float = 1.0,
        num_blocks: int | None = None,
        max_model_len: int | None = None,
        seed: int = 0,
        attention_backend: str = "torch",
        num_threads: int | None = None,
        gpu_memory_utilization: float = 0.9,
        swap_space_gib: float = 0.0,
        enforce_eager: bool | None = None,
        max_graph_batch_size: int = 64,
        speculative: str = "",
        cpu_kernels: bool = True,
        cpu_packed_weights: bool = True,
        cpu_huge_pages: bool = True,
        quantization: str = "",
        draft_model: str = "",
        prompt_lookup_min: int = 2,
        prompt_lookup_max: int = 4,
        tp: TensorParallel | None = None,
        progress: Callable[[str], None] | None = None,
        lora: LoraOptions | None = None,
    ) -> None:
        # start-up stages, for `shuttle serve`'s progress lines (the worker's report_progress)
        self.progress = progress or (lambda stage: None)
        if dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
        if num_threads is not None:
            torch.set_num_threads(num_threads)
        self.model_path = model_path
        # tensor parallelism: this rank's shard of each model; every rank runs every plan
        # and samples the same tokens from the same all-gathered logits (gpu_worker/rank.py)
        self.tp = tp or TensorParallel()
        self.dtype = DTYPES[dtype]
        self.device = torch.device(device)
        self.block_size = block_size
        self.gpu_memory_utilization = gpu_memory_utilization
        if speculative not in ("", "ngram", "draft") or (speculative == "draft") != bool(
            draft_model
        ):
            raise ValueError(
                f"speculative must be '', ngram, or draft with a draft model; got "
                f"{speculative!r} with draft model {draft_model!r}"
            )
        self.speculative = speculative
        # C kernels for few-row linears on the CPU (gpu_worker/cpu/linear.py); off: torch only
        self.cpu_kernels = cpu_kernels and self.device.type == "cpu"
        self.cpu_packed_weights = cpu_packed_weights
        # weights and KV cache in transparent huge pages (gpu_worker/cpu/huge_pages.py)
        self.cpu_huge_pages = cpu_huge_pages and self.device.type == "cpu"
        # '' or int8: a float checkpoint's linears quantized at load (gpu_worker/models/loader.py)
        self.quantization = quantization
        self.prompt_lookup = (prompt_lookup_min, prompt_lookup_max)
        # LoRA adapters (gpu_worker/lora/): made with the first model, attached to each
        self._lora_options = lora
        self.lora: LoraManager | None = None
        self._init_model(attention_backend, max_model_len)
        self.progress("allocating the KV cache")
        self._init_kv_cache(
            kv_cache_memory_gib, num_blocks, share=1 - self._draft_kv_share(draft_model)
        )
        self.drafter: DraftModel | None = None
        if speculative == "draft":
            self.drafter = DraftModel(
                draft_model,
                block_size=block_size,
                num_blocks=self.num_blocks,
                dtype=self.dtype,
                device=self.device,
                max_positions=self.max_model_len,
                attention_backend=self.backend.name,
                target_vocab_size=self.config.vocab_size,
            )
        self.num_host_blocks = self.kv_cache.allocate_host(int(swap_space_gib * GIB))
        # CUDA graphs for decode steps; eager on CPU, or when asked
        if self.device.type == "cuda":
            self.progress("capturing CUDA graphs of decode steps")
        self.graphs = maybe_capture_graphs(
            self.model,
            self.backend,
            self.kv_cache.tensor,
            block_size=block_size,
            max_model_len=self.max_model_len,
            # (graphs would capture the LoRA mapping's state once: eager with LoRA for now)
            enforce_eager=(self.device.type != "cuda" if enforce_eager is None else enforce_eager)
            or lora is not None,
            max_graph_batch_size=max_graph_batch_size,
        )
        self.versions = {
            self.weights_version: ModelVersion(
                self.model,
                self.graphs,
                self.config,
                self.model_path,
                list(self.eos_token_ids),
                TokenCounts(self.config.vocab_size, self.device),
            )
        }
        self.default_version = self.weights_version
        self._rng = random.Random(seed)
        self.requests = RequestTable(
            block_size=block_size,
            num_blocks=self.num_blocks,
            max_model_len=self.max_model_len,
            new_generator=lambda params: make_generator(params, self._rng, self.device),
            on_drop=self._release_counts,
            new_grammar=self._new_grammar,
            loras=self.lora.registry if self.lora else None,
        )
        self.grammars = GrammarCache(self._tokenizer_info)
        self._fingerprints: dict[str, str] = {}
        load_start_modules(self.load_lora, lora.modules if lora else ())

    @classmethod
    def from_config(
        cls,
        model_path: str,
        config: Config,
        tp: TensorParallel | None = None,
        progress: Callable[[str], None] | None = None,
    ) -> ModelRunner:
        """The runner the worker serves `model_path` with: every model, cache and speculative
        setting comes from `config`, here and nowhere else (`tp`: this rank's group)."""
        m, c, spec = config.model, config.cache, config.speculative
        swap = config.scheduler.preemption_mode == "swap"
        device, threads = rank_device_and_threads(config, tp or TensorParallel())
        return cls(
            model_path,
            dtype=m.resolved_dtype,
            device=device,
            block_size=c.block_size,
            kv_cache_memory_gib=c.kv_cache_memory,
            gpu_memory_utilization=c.gpu_memory_utilization,
            max_model_len=m.max_model_len or None,
            seed=m.seed,
            attention_backend=m.attention_backend,
            enforce_eager=m.enforce_eager or None,
            max_graph_batch_size=m.max_graph_batch_size,
            num_threads=threads,
            swap_space_gib=c.swap_space if swap else 0.0,
            speculative=spec.method,
            cpu_kernels=m.cpu_kernels,
            cpu_packed_weights=m.cpu_packed_weights,
            cpu_huge_pages=m.cpu_huge_pages,
            quantization=m.quantization,
            draft_model=str(Path(spec.draft_model).expanduser()) if spec.draft_model else "",
            prompt_lookup_min=spec.prompt_lookup_min,
            prompt_lookup_max=spec.prompt_lookup_max,
            tp=tp,
            progress=progress,
            lora=LoraOptions.from_flags(config.lora),
        )

    def _init_model(self, attention_backend: str, max_model_len: int | None) -> None:
        hf_config = read_hf_config(self.model_path)
        self.config = LlamaConfig.from_hf(hf_config)
        check_tensor_parallel(self.config, self.tp.size, self.model_path)
        limit = self.config.max_position_embeddings
        self.max_model_len = min(limit, max_model_len) if max_model_len else limit
        self.backend = self._create_backend(attention_backend, self.config, self.model_path)
        self.model = self._load_model(self.model_path, self.backend)
        self.eos_token_ids = eos_token_ids(self.model_path, hf_config)
        self.weights_version = weights_version(self.model_path)

    def _create_backend(self, name: str, config: LlamaConfig, path: str) -> AttentionBackend:
        """An attention backend for this rank's heads of `config`; batch-invariant for a
        model whose linears quantize activations (the torch backend on the CPU: a chunk's
        queries by the decode kernel, so a rounding to int8 never depends on the chunking)."""
        name = resolve_backend_name(name, self.device)
        quantized = stores_quantized(path, self.quantization)
        extra = {"batch_invariant": True} if name == "torch" and quantized else {}
        return create_backend(
            name,
            num_heads=config.num_heads // self.tp.size,
            num_kv_heads=config.num_kv_heads // self.tp.size,
            head_dim=config.head_dim,
            dtype=self.dtype,
            device=self.device,
            **extra,
        )

    def _load_model(self, path: str, backend: AttentionBackend) -> LlamaForCausalLM:
        self.progress("choosing kernels (the C kernels are built by gcc on first use)")
        kernels = choose_kernels(
            device=self.device,
            backend_name=backend.name,
            dtype=self.dtype,
            cpu_kernels=self.cpu_kernels,
            cpu_packed_weights=self.cpu_packed_weights,
        )
        self.progress(f"reading weights from {path} ({kernels.describe()})")
        model = load_model(
            path,
            backend,
            dtype=self.dtype,
            device=self.device,
            max_positions=self.max_model_len,
            tp=self.tp,
            kernels=kernels,
            quantization=self.quantization,
        )
        log.info(
            "model %s: %.1f MB of weights resident (%s), %s",
            path,
            resident_weight_bytes(model) / 1e6,
            quantization_of(model) or "float",
            kernels.describe(),
        )
        if self.cpu_huge_pages:
            use_huge_pages(model)
        if self._lora_options is not None:
            if self.lora is None:
                self.lora = LoraManager(
                    self._lora_options, model.config, (self.tp.rank, self.tp.size)
                )
            self.lora.attach(model, max_tokens=256)
        return model

    def _draft_kv_share(self, draft_model: str) -> float:
        """The draft model's part of the KV budget: its pool has as many blocks as the
        target's, so the budget is split by their bytes per block."""
        if not draft_model:
            return 0.0
        draft = LlamaConfig.from_hf(read_hf_config(draft_model))
        # this rank's KV heads of the target; the draft model is whole on every rank
        kv_heads = self.config.num_kv_heads // self.tp.size
        mine = self.config.num_layers * kv_heads * self.config.head_dim
        theirs = draft.num_layers * draft.num_kv_heads * draft.head_dim
        return theirs / (mine + theirs)

    def _init_kv_cache(self, memory_gib: float, num_blocks: int | None, share: float) -> None:
        """The target's pool: `share` of the KV budget (the rest is the draft model's). Under
        tensor parallelism it holds this rank's KV heads, and every rank takes the number of
        blocks the tightest rank can hold, so one block id means one block everywhere."""
        layout: dict[str, Any] = dict(
            num_layers=self.config.num_layers,
            block_size=self.block_size,
            num_kv_heads=self.config.num_kv_heads // self.tp.size,
            head_dim=self.config.head_dim,
            dtype=self.dtype,
        )
        if num_blocks is None:
            budget = kv_budget_bytes(self.device, memory_gib, self.gpu_memory_utilization, share)
            per_block = bytes_per_block(**layout)
            num_blocks = budget // per_block
            if num_blocks < 1:
                raise ValueError(f"KV budget of {budget} bytes holds no block of {per_block} bytes")
        num_blocks = self.tp.agree_min(num_blocks)
        self.kv_cache = KVCache(
            num_blocks=num_blocks, device=self.device, huge_pages=self.cpu_huge_pages, **layout
        )
        self.num_blocks = self.kv_cache.num_blocks

    def model_info(self) -> ModelInfo:
        """What the worker tells the scheduler at start-up (the Ready message's model)."""
        return ModelInfo(
            model_type=self.config.model_type,
            num_layers=self.config.num_layers,
            num_kv_heads=self.config.num_kv_heads,
            head_dim=self.config.head_dim,
            dtype=str(self.dtype).removeprefix("torch."),
            num_blocks=self.num_blocks,
            block_size=self.block_size,
            max_model_len=self.max_model_len,
            vocab_size=self.config.vocab_size,
            eos_token_ids=list(self.eos_token_ids),
            weights_version=self.weights_version,
            num_host_blocks=self.num_host_blocks,
            device=str(self.device),
            speculative=self.speculative,
            tensor_parallel_size=self.tp.size,
            weight_bytes=resident_weight_bytes(self.model),
            quantization=quantization_of(self.model),
            **(self.lora.registry.model_info_fields() if self.lora else {}),
        )

    # LoRA adapters ---------------------------------------------------------------------------
    def load_lora(self, name: str, path: str) -> AdapterSpec:
        """Read a PEFT adapter folder into the host cache under `name` (gpu_worker/lora/)."""
        if self.lora is None:
            raise LoraAdapterError(f"{path}: LoRA is not enabled (--enable-lora)")
        return self.lora.load(name, path)

    def unload_lora(self, name: str) -> None:
        if self.lora is None:
            raise KeyError(f"LoRA adapter {name!r} is not loaded (LoRA is not enabled)")
        self.lora.unload(name)

    # model versions (hot swap) -------------------------------------------------------------
    def load_version(self, path: str, version: str = "") -> str:
        """Load another model beside the served ones, sharing the KV pool; returns its
        version (default: a hash of its weight files). Raises IncompatibleModel when its KV
        layout differs from the pool's."""
        hf_config = read_hf_config(path)
        config = LlamaConfig.from_hf(hf_config)
        have = (self.config.num_layers, self.config.num_kv_heads, self.config.head_dim)
        want = (config.num_layers, config.num_kv_heads, config.head_dim)
        if want != have:
            raise IncompatibleModel(
                f"{path} has KV layout (layers, kv heads, head dim) {want}, "
                f"the pool holds {have}: swap it in drain mode"
            )
        version = version or weights_version(path)
        if version in self.versions:
            raise ValueError(f"model version {version!r} is already loaded")
        check_tensor_parallel(config, self.tp.size, path)
        backend = self._create_backend(self.backend.name, config, path)
        model = self._load_model(path, backend)
        graphs = maybe_capture_graphs(
            model,
            backend,
            self.kv_cache.tensor,
            block_size=self.block_size,
            max_model_len=self.max_model_len,
            enforce_eager=self.graphs is None,
            max_graph_batch_size=self.graphs.max_batch_size if self.graphs else 0,
        )
        self.versions[version] = ModelVersion(
            model,
            graphs,
            config,
            path,
            eos_token_ids(path, hf_config),
            TokenCounts(config.vocab_size, self.device),
        )
        return version

    def set_default_version(self, version: str) -> None:
        """New requests without an explicit version run on `version` from now on."""
        loaded = self.versions[version]
        self.default_version = version
        self.model, self.graphs, self.config = loaded.model, loaded.graphs, loaded.config
        self.model_path, self.weights_version = loaded.path, version
        self.eos_token_ids = loaded.eos_token_ids
        if self.lora is not None:  # adapters loaded from now on must fit the served model
            self.lora.registry.shape = model_shape(loaded.config)

    def unload_version(self, version: str) -> None:
        """Free a version's weights once no request uses it."""
        if version == self.default_version:
            raise ValueError(f"version {version!r} is the default; switch first")
        users = self.requests.num_serving(version)
        if users:
            raise ValueError(f"version {version!r} still serves {users} requests")
        del self.versions[version]

    # structured outputs ----------------------------------------------------------------------
    def compile_grammar(
        self, kind: str, spec: str, tokenizer_fingerprint: str
    ) -> concurrent.futures.Future[None]:
        """Compile on the cache's background thread (gpu_worker/structured.py)."""
        fingerprint = tokenizer_fingerprint or self._fingerprint(self.default_version)
        return self.grammars.submit(kind, spec, fingerprint)

    def _fingerprint(self, version: str) -> str:
        path = self.versions[version].path
        if path not in self._fingerprints:  # (a hash of the tokenizer files: once per folder)
            self._fingerprints[path] = tokenizer_fingerprint(Path(path))
        return self._fingerprints[path]

    def _tokenizer_info(self, fingerprint: str) -> xgrammar.TokenizerInfo:
        """xgrammar's view of the tokenizer of a loaded version with that fingerprint."""
        for version, loaded in list(self.versions.items()):
            if self._fingerprint(version) == fingerprint:
                vocab, stops = loaded.config.vocab_size, list(loaded.eos_token_ids)
                return hf_tokenizer_info(loaded.path, vocab, stops)
        raise KeyError(fingerprint)

    def _new_grammar(self, params: SamplingParams, version: str) -> RowGrammar | None:
        """A new sequence's matcher, for the tokenizer of the version that serves it."""
        return self.grammars.matcher(params, self._fingerprint(version))

    # a step ----------------------------------------------------------------------------------
    def execute(self, plan: StepPlan) -> StepResult:
        """Apply the plan's diffs, run its batch, and return the sampled tokens."""
        start = time.perf_counter()
        states = self._begin_step(plan, self.kv_cache)
        if not plan.req_ids:
            return StepResult(step_id=plan.step_id, req_ids=[], token_ids=[])
        sampled: dict[str, list[int]] = {}
        proposed: dict[str, int] = {}
        logprobs: dict[str, tuple[list[list[int]], list[list[float]]]] = {}
        prompt: dict[str, PromptEntries] = {}
        for version, indices in self._by_version(states).items():  # one forward per version
            batch = self._prepare_batch(plan, indices, states)
            loaded = self.versions[version]
            if self.lora is not None:  # each token's adapter slot, in the packed order
                rows = [(states[i].lora_name, n) for i, n in batch.packed]
                self.lora.set_step(loaded.model, rows)
            with torch.inference_mode():
                logits = run_model(
                    loaded.model,
                    loaded.graphs,
                    batch.input_ids,
                    self.kv_cache.tensor,
                    batch.meta,
                    batch.logits_indices,
                )
                add_prompt_entries(logits[batch.num_sampling_rows :], batch.prompt_rows)
                accepted = self._accept(logits[: batch.num_sampling_rows], batch, loaded.counts)
                for rid, tokens in zip(batch.sampling_req_ids, accepted, strict=True):
                    sampled[rid] = tokens
                logprobs |= output_entries(
                    logits, batch.sampling_req_ids, batch.sampling_states, batch.drafts, accepted
                )
            prompt |= {
                rid: take_prompt_logprobs(state)
                for rid, state in zip(batch.sampling_req_ids, batch.sampling_states, strict=True)
                if state.params.prompt_logprobs is not None
            }
            for rid, drafts in zip(batch.sampling_req_ids, batch.drafts, strict=True):
                proposed[rid] = len(drafts)
        order = [rid for rid in plan.req_ids if rid in sampled]
        spec = bool(plan.num_spec_tokens)
        return StepResult(
            step_id=plan.step_id,
            req_ids=order,
            token_ids=[t for rid in order for t in sampled[rid]],
            num_tokens=[len(sampled[rid]) for rid in order] if spec else [],
            num_proposed=[proposed[rid] for rid in order] if spec else [],
            **step_result_fields(order, sampled, logprobs, prompt),
            forward_s=time.perf_counter() - start,
        )

    def _accept(self, logits: torch.Tensor, batch: _Batch, counts: TokenCounts) -> list[list[int]]:
        """Each sampling request's tokens: one sampled, or its verified drafts plus one.
        A verified request's accepted drafts count as computed; the blocks past them (only
        rejected drafts' slots) leave its table, as they leave the scheduler's."""
        states = batch.sampling_states
        first = list(itertools.accumulate((1 + len(d) for d in batch.drafts), initial=0))
        grammars = [(first[j], s.grammar, s.output_ids) for j, s in enumerate(states) if s.grammar]
        if grammars:  # masked on a copy: logprobs come from the raw logits
            logits = logits.clone()
            apply_grammars(logits, grammars)
        if not any(batch.spec_slots):  # no speculation: one logits row each, sampled at once
            tokens = sample(
                logits,
                [s.params for s in states],
                [s.generator for s in states],
                History(states, counts),
            )
            for state, token in zip(states, tokens, strict=True):
                state.token_ids.append(token)
            return [[t] for t in tokens]
        plain = [j for j, slots in enumerate(batch.spec_slots) if not slots]
        out: list[list[int]] = [[] for _ in states]
        if plain:
            tokens = sample(
                logits[[first[j] for j in plain]],
                [states[j].params for j in plain],
                [states[j].generator for j in plain],
                History([states[j] for j in plain], counts),
            )
            for j, token in zip(plain, tokens, strict=True):
                out[j] = [token]
        for j, state in enumerate(states):
            if batch.spec_slots[j]:
                verdict = verify(
                    logits[first[j] : first[j + 1]],
                    batch.drafts[j],
                    state.params,
                    state.generator,
                    batch.draft_probs[j],
                )
                out[j] = verdict.tokens
                state.num_computed += verdict.num_accepted
                del state.block_table[-(-state.num_computed // self.block_size) :]
                state.draft_computed = min(batch.draft_computed[j], state.num_computed)
            state.token_ids.extend(out[j])
        return out

    def _release_counts(self, state: RequestState) -> None:
        """A request left the worker: free its token counts."""
        loaded = self.versions.get(state.version)
        if loaded is not None:
            loaded.counts.release(state.req_id)

    def _by_version(self, states: list[RequestState]) -> dict[str, list[int]]:
        groups: dict[str, list[int]] = {}
        for i, state in enumerate(states):
            groups.setdefault(state.version, []).append(i)
        return groups

    def _prepare_batch(
        self, plan: StepPlan, indices: list[int], states: list[RequestState]
    ) -> _Batch:
        """The packed inputs of the scheduled requests `indices` (one model version), whose
        states `schedule` has checked and advanced."""
        slots = plan.num_spec_tokens or [0] * len(plan.req_ids)
        drafts, draft_probs, draft_computed = self._propose(indices, states, slots)
        # decodes first (stable), so the backend sees them as one contiguous batch
        num_new = {i: plan.num_new_tokens[i] + len(drafts[i]) for i in indices}
        order = sorted(indices, key=lambda i: num_new[i] != 1)
        input_ids: list[int] = []
        first_row: dict[int, int] = {}  # packed index of the request's last known token
        for i in order:
            num_computed = plan.num_computed_tokens[i]
            input_ids.extend(
                states[i].token_ids[num_computed : num_computed + plan.num_new_tokens[i]]
            )
            first_row[i] = len(input_ids) - 1
            input_ids.extend(drafts[i])
        meta = build_metadata(
            [plan.num_computed_tokens[i] for i in order],
            [num_new[i] for i in order],
            [states[i].block_table for i in order],
            self.block_size,
            self.device,
        )
        sampling = [i for i in indices if states[i].needs_sample]
        logits_indices = [
            k for i in sampling for k in range(first_row[i], first_row[i] + 1 + len(drafts[i]))
        ]
        # prompt logprobs: the asking requests' prompt positions of this chunk, after those
        prompt_rows = []
        for i in indices:
            num_computed, chunk = plan.num_computed_tokens[i], plan.num_new_tokens[i]
            positions = prompt_positions(states[i], num_computed, chunk)
            if positions:
                chunk_start = first_row[i] + 1 - chunk  # packed index of num_computed
                logits_indices += [chunk_start + p - num_computed for p in positions]
                prompt_rows.append((states[i], positions))
        return _Batch(
            input_ids=torch.tensor(input_ids, dtype=torch.int64).to(self.device),
            meta=self.backend.build_metadata(meta),
            logits_indices=torch.tensor(logits_indices, dtype=torch.int64, device=self.device),
            sampling_req_ids=[plan.req_ids[i] for i in sampling],
            sampling_states=[states[i] for i in sampling],
            drafts=[drafts[i] for i in sampling],
            draft_probs=[draft_probs[i] for i in sampling],
            spec_slots=[slots[i] for i in sampling],
            draft_computed=[draft_computed[i] for i in sampling],
            prompt_rows=prompt_rows,
            packed=[(i, num_new[i]) for i in order],
        )

    def _propose(
        self,
        indices: list[int],
        states: list[RequestState],
        slots: list[int],
    ) -> tuple[dict[int, list[int]], dict[int, torch.Tensor | None], dict[int, int]]:
        """Draft tokens for the requests given draft slots (decodes of their last token)."""
        drafts: dict[int, list[int]] = {i: [] for i in indices}
        probs: dict[int, torch.Tensor | None] = {i: None for i in indices}
        computed = {i: states[i].draft_computed for i in indices}
        spec = [i for i in indices if slots[i]]
        if not spec or not self.speculative:
            return drafts, probs, computed
        if self.drafter is None:  # n-gram lookup in the request's own tokens
            for i in spec:
                drafts[i] = ngram_propose(states[i].token_ids, slots[i], *self.prompt_lookup)
            return drafts, probs, computed
        got, q, after = self.drafter.propose(
            [states[i].token_ids for i in spec],
            [states[i].draft_computed for i in spec],
            [states[i].block_table for i in spec],
            [slots[i] for i in spec],
            [states[i].params for i in spec],
            [states[i].generator for i in spec],
        )
        for j, i in enumerate(spec):
            drafts[i], probs[i], computed[i] = got[j], q[j], after[j]
        return drafts, probs, computed
