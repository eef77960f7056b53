"""The model runner: the real `Runner` (gpu_worker/runner/base.py). It runs the model and
samples.

The per-request state and the StepPlan rules are the shared `RequestTable`'s; this runner
hands it its KV cache for the plan's copies and adds what needs a model. A step:

    drop finished -> swap out -> reset preempted -> add new -> swap in -> copy-on-write ->
    check each scheduled request and append its new blocks (RequestTable) ->
    compute token_ids[num_computed : num_computed + num_new] for each, and for those that
    reach the end of their tokens sample one token (or verify drafts) and append it;
    logprobs for the requests that ask (gpu_worker/sample/logprobs.py).

Its settings are one `RunnerOptions` (gpu_worker/runner/options.py), its weights the
`ModelVersions` (gpu_worker/runner/versions.py: the default one serves new requests), and a
step's inputs are packed per version by gpu_worker/runner/step_batch.py, decodes first; results go
back in the plan's order.
"""

from __future__ import annotations

import concurrent.futures
import logging
import random
import time
import uuid
from collections.abc import Callable
from typing import Any

import torch

from common.config import Config
from common.messages.scheduler_worker import StepPlan, StepResult
from common.messages.types import ModelInfo, SamplingParams
from gpu_worker.attention import AttentionBackend
from gpu_worker.distributed.tensor_parallel import TensorParallel
from gpu_worker.kv_cache import GIB
from gpu_worker.kv_handover import KVHandover
from gpu_worker.kv_tiers import KVTierStore
from gpu_worker.layers.fused_moe import add_counts, take_tokens_per_expert
from gpu_worker.layers.linear import quantization_of, resident_weight_bytes
from gpu_worker.lora.adapter import AdapterSpec, LoraAdapterError
from gpu_worker.lora.manager import LoraManager, model_shape
from gpu_worker.lora.registry import load_start_modules
from gpu_worker.model_loader.hf_folder import read_hf_config, weights_version
from gpu_worker.models.llama import LlamaForCausalLM
from gpu_worker.models.llama_config import LlamaConfig
from gpu_worker.runner.base import PlanRunner
from gpu_worker.runner.builder import load_weights
from gpu_worker.runner.cuda_graphs import CUDAGraphRunner, maybe_capture_graphs, run_model
from gpu_worker.runner.kv_pool import allocate_kv_pool, kv_layer_groups
from gpu_worker.runner.options import DEFAULT_OPTIONS, RunnerOptions
from gpu_worker.runner.request_table import RequestState, RequestTable
from gpu_worker.runner.step_batch import StepBatch, accept, prepare_batch, propose
from gpu_worker.runner.versions import Built, ModelVersion, ModelVersions
from gpu_worker.sample.logprobs import (
    PromptEntries,
    add_prompt_entries,
    output_entries,
    step_result_fields,
    take_prompt_logprobs,
)
from gpu_worker.sample.pooling import pooled_fields
from gpu_worker.sample.sampling import make_generator
from gpu_worker.sample.speculative import DraftModel
from gpu_worker.sample.structured import GrammarCache, RowGrammar

log = logging.getLogger(__name__)


class ModelRunner(PlanRunner[ModelVersion]):
    """Owns the weights, the KV cache and every request's worker-side state: a `Runner`
    (gpu_worker/runner/base.py) whose plan rules are the shared `RequestTable`'s; this class
    adds the KV copies, the forward passes, sampling and speculative decoding."""

    versions: ModelVersions

    def __init__(
        self,
        model_path: str,
        options: RunnerOptions = DEFAULT_OPTIONS,
        *,
        tp: TensorParallel | None = None,
        progress: Callable[[str], None] | None = None,
    ) -> None:
        # start-up stages, for `shuttle serve`'s progress lines (the worker's report_progress)
        self.progress = progress or (lambda stage: None)
        self.options = options
        if options.num_threads is not None:
            torch.set_num_threads(options.num_threads)
        # tensor parallelism: this rank's shard of each model; every rank runs every plan
        # and samples the same tokens from the same all-gathered logits (gpu_worker/rank.py)
        self.tp = tp or TensorParallel()
        self.dtype, self.device = options.torch_dtype, options.torch_device
        hf_config = read_hf_config(model_path)
        config = LlamaConfig.from_hf(hf_config)
        limit = config.max_position_embeddings
        self.max_model_len = min(limit, options.max_model_len or limit)
        # LoRA adapters (gpu_worker/lora/): one manager, its slots attached to each version
        self.lora: LoraManager | None = None
        if options.lora is not None:
            self.lora = LoraManager(options.lora, config, (self.tp.rank, self.tp.size))
        backend, model = self._load_weights(model_path, hf_config)
        self.progress("allocating the KV cache")
        # sliding-window layers: one block table per layer group, blocks of one group's
        # layers (common/kv_groups.py); None: the dense layout
        self.kv_groups = kv_layer_groups(config, options)
        self.kv_cache = allocate_kv_pool(config, options, self.tp, self.kv_groups)
        self.kv_pool_id = uuid.uuid4().hex  # (the scheduler forgets another pool's prefixes)
        self.drafter = self._init_drafter(config, backend.name)
        self.num_host_blocks = self.kv_cache.allocate_host(int(options.swap_space_gib * GIB))
        self.handover = KVHandover(self.kv_cache, self.tp)  # prefill/decode replicas
        self.tiers = KVTierStore.create(
            self.kv_cache,
            memory_gib=options.kv_offload_memory_gib,
            folder=options.kv_offload_dir,
            disk_gib=options.kv_offload_disk_gib,
            version=weights_version(model_path),
            tp=self.tp,
        )
        if self.device.type == "cuda":
            self.progress("capturing CUDA graphs of decode steps")
        built = (backend, model, self._capture(backend, model))
        first = ModelVersion.create(model_path, hf_config, config, built, self.device)
        self.versions = ModelVersions(weights_version(model_path), first, self._build)
        self._rng = random.Random(options.seed)
        self.requests = RequestTable(
            block_size=options.block_size,
            num_blocks=self.num_blocks,
            max_model_len=self.max_model_len,
            new_generator=lambda params, version, num_drawn: make_generator(
                params, self._rng, self.device, num_drawn, self.versions[version].config.vocab_size
            ),
            on_drop=self._release_counts,
            new_grammar=self._new_grammar,
            loras=self.lora.registry if self.lora else None,
            group_windows=self.kv_groups.windows if self.kv_groups else (),
        )
        self.grammars = GrammarCache(self.versions.tokenizer_info)
        load_start_modules(self.load_lora, options.lora.modules if options.lora else ())

    @classmethod
    def from_config(
        cls,
        model_path: str,
        config: Config,
        tp: TensorParallel | None = None,
        progress: Callable[[str], None] | None = None,
    ) -> ModelRunner:
        """The runner the worker serves `model_path` with (`tp`: this rank's group)."""
        return cls(model_path, RunnerOptions.from_config(config, tp), tp=tp, progress=progress)

    # the default version's facts (the Runner protocol of gpu_worker/runner/base.py)
    @property
    def model_path(self) -> str:
        return self.versions.default.path

    @property
    def eos_token_ids(self) -> list[int]:
        return self.versions.default.eos_token_ids

    @property
    def config(self) -> LlamaConfig:
        return self.versions.default.config

    @property
    def model(self) -> LlamaForCausalLM:
        return self.versions.default.model

    @property
    def backend(self) -> AttentionBackend:
        return self.versions.default.backend

    @property
    def block_size(self) -> int:
        return self.options.block_size

    @property
    def num_blocks(self) -> int:
        return self.kv_cache.num_blocks

    # start-up ------------------------------------------------------------------------------
    def _load_weights(
        self, path: str, hf_config: dict[str, Any]
    ) -> tuple[AttentionBackend, LlamaForCausalLM]:
        """This rank's shard of the model at `path`, and an attention backend for it."""
        backend, model = load_weights(
            path,
            hf_config,
            self.options,
            tp=self.tp,
            max_model_len=self.max_model_len,
            progress=self.progress,
            attach_lora=self._attach_lora if self.lora is not None else None,
        )
        return backend, model

    def _attach_lora(self, model: LlamaForCausalLM, kernel: str) -> None:
        """A loaded model's LoRA layers and slots, with the kernel chosen beside its linears."""
        assert self.lora is not None
        self.lora.attach(model, max_tokens=256, kernel=kernel)

    def _build(self, path: str, hf_config: dict[str, Any]) -> Built:
        """A version's backend, weights and decode graphs (after the first: the pool exists)."""
        backend, model = self._load_weights(path, hf_config)
        return backend, model, self._capture(backend, model)

    def _capture(
        self, backend: AttentionBackend, model: LlamaForCausalLM
    ) -> CUDAGraphRunner | None:
        """CUDA graphs of decode steps over the pool; None when eager (the CPU, or asked)."""
        return maybe_capture_graphs(
            model,
            backend,
            self.kv_cache.tensor,
            block_size=self.block_size,
            max_model_len=self.max_model_len,
            # a MoE layer groups tokens by expert on the host (data-dependent): eager; so
            # are KV layer groups (a block table per group: the graphs capture one)
            enforce_eager=self.options.eager
            or model.config.moe is not None
            or getattr(self, "kv_groups", None) is not None,
            max_graph_batch_size=self.options.max_graph_batch_size,
        )

    def _init_drafter(self, config: LlamaConfig, backend_name: str) -> DraftModel | None:
        """The draft model (--speculative draft), with a pool of as many blocks as ours."""
        if self.options.speculative != "draft":
            return None
        return DraftModel(
            self.options.draft_model,
            block_size=self.block_size,
            num_blocks=self.num_blocks,
            dtype=self.dtype,
            device=self.device,
            max_positions=self.max_model_len,
            attention_backend=backend_name,
            target_vocab_size=config.vocab_size,
        )

    def model_info(self) -> ModelInfo:
        """What the worker tells the scheduler at start-up (the Ready message's model)."""
        config = self.config
        return ModelInfo(
            model_type=config.model_type,
            num_layers=config.num_layers,
            num_kv_heads=config.num_kv_heads,
            head_dim=config.head_dim,
            dtype=str(self.dtype).removeprefix("torch."),
            num_blocks=self.num_blocks,
            block_size=self.block_size,
            max_model_len=self.max_model_len,
            vocab_size=config.vocab_size,
            eos_token_ids=list(self.eos_token_ids),
            weights_version=self.default_version,
            num_host_blocks=self.num_host_blocks,
            kv_group_windows=list(self.kv_groups.windows) if self.kv_groups else [],
            **self._tier_info(),
            kv_cache_dtype=self.kv_cache.format.describe(),
            device=str(self.device),
            speculative=self.options.speculative,
            tensor_parallel_size=self.tp.size,
            weight_bytes=resident_weight_bytes(self.model),
            quantization=quantization_of(self.model),
            kv_pool_id=self.kv_pool_id,
            **(self.lora.registry.model_info_fields() if self.lora else {}),
        )

    def _tier_info(self) -> dict[str, Any]:
        """ModelInfo's fields for the lower tiers: their sizes, and what is on disk."""
        if self.tiers is None:
            return {}
        keys, tokens = self.tiers.disk_contents()
        return dict(
            num_tier_host_blocks=self.tiers.num_host_slots,
            num_tier_disk_blocks=self.tiers.num_disk_blocks,
            tier_block_bytes=self.kv_cache.block_bytes,
            tier_disk_keys=keys,
            tier_disk_tokens=tokens,
            tier_store_id=self.tiers.store_id,
        )

    def close(self) -> None:
        """Finish the disk tier's queued writes (before another runner scans the folder)."""
        if self.tiers is not None:
            self.tiers.close()

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
        return self.versions.load(path, version)

    def set_default_version(self, version: str) -> None:
        super().set_default_version(version)
        if self.lora is not None:  # adapters loaded from now on must fit the served model
            self.lora.registry.shape = model_shape(self.config)
        if self.tiers is not None:  # files written from now on name the served weights
            self.tiers.set_version(weights_version(self.model_path))

    def unload_version(self, version: str) -> None:
        """Free a version's weights once no request uses it."""
        self.versions.unload(version, self.requests.num_serving(version))

    # structured outputs ----------------------------------------------------------------------
    def compile_grammar(
        self, kind: str, spec: str, tokenizer_fingerprint: str
    ) -> concurrent.futures.Future[None]:
        """Compile on the cache's background thread (gpu_worker/sample/structured.py)."""
        fingerprint = tokenizer_fingerprint or self.versions.fingerprint(self.default_version)
        return self.grammars.submit(kind, spec, fingerprint)

    def _new_grammar(self, params: SamplingParams, version: str) -> RowGrammar | None:
        """A new sequence's matcher, for the tokenizer of the version that serves it."""
        return self.grammars.matcher(params, self.versions.fingerprint(version))

    # a step ----------------------------------------------------------------------------------
    def execute(self, plan: StepPlan, report: Callable[[Any], None] | None = None) -> StepResult:
        """Apply the plan's diffs, run its batch, and return the sampled tokens; `report`
        sends what is done before the step (a hand-over's exports) at once."""
        start = time.perf_counter()
        fetched, failed = self.tiers.apply(plan) if self.tiers is not None else ([], [])
        tiers: dict[str, Any] = dict(tier_fetched_keys=fetched, tier_fetch_failed_keys=failed)
        # (blocks handed over: before the step writes; the exports reported at once where
        # this process writes them all: with ranks, each writes its own, and the result,
        # after the step's collectives, is what says every rank's are written)
        early = report if self.tp.size == 1 else None
        tiers |= self.handover.apply(plan, early)
        states = self._begin_step(plan, self.kv_cache)
        if not plan.req_ids:
            return StepResult(step_id=plan.step_id, req_ids=[], token_ids=[], **tiers)
        sampled: dict[str, list[int]] = {}
        proposed: dict[str, int] = {}
        logprobs: dict[str, tuple[list[list[int]], list[list[float]]]] = {}
        prompt: dict[str, PromptEntries] = {}
        pooled: dict[str, list[float]] = {}  # embeddings requests done this step
        expert_tokens: list[int] = []  # a MoE model's pairs per expert (fused_moe.py)
        for version, indices in self._by_version(states).items():  # one forward per version
            loaded = self.versions[version]
            batch = self._prepare_batch(plan, indices, states, loaded.backend)
            if self.lora is not None:  # each token's adapter slot, in the packed order
                rows = [(states[i].lora_name, n) for i, n in batch.packed]
                self.lora.set_step(loaded.model, rows)
            with torch.inference_mode():
                logits, vectors = run_model(
                    loaded.model,
                    loaded.graphs,
                    batch.input_ids,
                    self.kv_cache.tensor,
                    batch.meta,
                    batch.logits_indices,
                    batch.pool,
                )
                pooled |= vectors
                expert_tokens = add_counts(expert_tokens, take_tokens_per_expert(loaded.model))
                add_prompt_entries(logits[batch.num_sampling_rows :], batch.prompt_rows)
                rows = logits[: batch.num_sampling_rows]
                accepted = accept(rows, batch, loaded.counts, self.block_size)
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
            **pooled_fields(plan.req_ids, pooled),
            **tiers,
            forward_s=time.perf_counter() - start,
            expert_tokens=expert_tokens,
        )

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
        self,
        plan: StepPlan,
        indices: list[int],
        states: list[RequestState],
        backend: AttentionBackend,
    ) -> StepBatch:
        """The packed inputs of the scheduled requests `indices` (one model version), their
        drafts proposed first (gpu_worker/runner/step_batch.py)."""
        drafts = propose(
            plan,
            indices,
            states,
            method=self.options.speculative,
            drafter=self.drafter,
            prompt_lookup=self.options.prompt_lookup,
        )
        return prepare_batch(
            plan,
            indices,
            states,
            drafts,
            block_size=self.block_size,
            backend=backend,
            device=self.device,
        )
