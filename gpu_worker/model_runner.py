"""The model runner: applies a StepPlan's diffs to per-request state, runs the model, samples.

Per request the runner keeps all token ids (prompt + sampled), the block table, how many
tokens are in the KV cache, the sampling parameters and a generator. A step:

    drop finished -> swap out -> reset preempted -> add new -> swap in -> copy-on-write ->
    for each scheduled request: append its new
    blocks, compute token_ids[num_computed : num_computed + num_new], and if that reaches the
    end of its tokens, sample one token and append it.

The batch is reordered internally so single-token decodes come first (the attention backend
runs them as one batch); results go back in the plan's order.
"""

from __future__ import annotations

import dataclasses
import itertools
import random
import time
from typing import Any

import torch

from common.messages.scheduler_worker import StepPlan, StepResult
from common.messages.types import SamplingParams
from gpu_worker.attention import AttentionMetadata, build_metadata, create_backend
from gpu_worker.cuda_graphs import maybe_capture_graphs, run_model
from gpu_worker.kv_cache import GIB, KVCache, cuda_kv_budget_bytes
from gpu_worker.models.llama import LlamaConfig
from gpu_worker.models.loader import eos_token_ids, load_model, read_hf_config, weights_version
from gpu_worker.sampling import make_generator, sample
from gpu_worker.speculative import DraftModel, ngram_propose, verify

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclasses.dataclass
class RequestState:
    """What the worker remembers about one request between steps."""

    token_ids: list[int]  # prompt + sampled so far
    params: SamplingParams
    generator: torch.Generator | None  # None for greedy requests
    block_table: list[int] = dataclasses.field(default_factory=list)
    num_computed: int = 0  # tokens whose K/V are in the cache
    version: str = ""  # the model version that serves it, for its whole life
    draft_computed: int = 0  # tokens whose K/V are in the draft model's pool


@dataclasses.dataclass
class ModelVersion:
    """One loaded set of weights; several can share the KV pool when their layout matches."""

    model: torch.nn.Module
    graphs: Any
    config: LlamaConfig
    path: str
    eos_token_ids: list[int]


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


class ModelRunner:
    """Owns the weights, the KV cache and every request's worker-side state."""

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
        draft_model: str = "",
        prompt_lookup_min: int = 2,
        prompt_lookup_max: int = 4,
    ) -> None:
        if dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
        if num_threads is not None:
            torch.set_num_threads(num_threads)
        self.model_path = model_path
        self.dtype = DTYPES[dtype]
        self.device = torch.device(device)
        self.block_size = block_size
        if speculative not in ("", "ngram", "draft") or (speculative == "draft") != bool(
                draft_model):
            raise ValueError(f"speculative must be '', ngram, or draft with a draft model; got "
                             f"{speculative!r} with draft model {draft_model!r}")
        self.speculative = speculative
        self.prompt_lookup = (prompt_lookup_min, prompt_lookup_max)
        self._init_model(attention_backend, max_model_len)
        self._init_kv_cache(kv_cache_memory_gib, num_blocks, gpu_memory_utilization,
                            share=1 - self._draft_kv_share(draft_model))
        self.drafter: DraftModel | None = None
        if speculative == "draft":
            self.drafter = DraftModel(
                draft_model, block_size=block_size, num_blocks=self.num_blocks,
                dtype=self.dtype, device=self.device, max_positions=self.max_model_len,
                attention_backend=self.backend.name, target_vocab_size=self.config.vocab_size)
        self.num_host_blocks = self.kv_cache.allocate_host(int(swap_space_gib * GIB))
        # CUDA graphs for decode steps; eager on CPU, or when asked
        self.graphs = maybe_capture_graphs(
            self.model, self.backend, self.kv_cache.tensor, block_size=block_size,
            max_model_len=self.max_model_len,
            enforce_eager=(self.device.type != "cuda") if enforce_eager is None else enforce_eager,
            max_graph_batch_size=max_graph_batch_size)
        self.versions[self.weights_version] = ModelVersion(
            self.model, self.graphs, self.config, self.model_path, list(self.eos_token_ids))
        self.default_version = self.weights_version
        self._rng = random.Random(seed)
        self._requests: dict[str, RequestState] = {}

    def _init_model(self, attention_backend: str, max_model_len: int | None) -> None:
        hf_config = read_hf_config(self.model_path)
        self.config = LlamaConfig.from_hf(hf_config)
        limit = self.config.max_position_embeddings
        self.max_model_len = min(limit, max_model_len) if max_model_len else limit
        self.backend = create_backend(
            attention_backend,
            num_heads=self.config.num_heads,
            num_kv_heads=self.config.num_kv_heads,
            head_dim=self.config.head_dim,
            dtype=self.dtype,
            device=self.device,
        )
        self.model = load_model(
            self.model_path,
            self.backend,
            dtype=self.dtype,
            device=self.device,
            max_positions=self.max_model_len,
        )
        if self.backend.name == "triton":  # fused RMSNorm / rotary kernels in the layers
            from gpu_worker.kernels.fused_layers import use_triton_layers

            use_triton_layers(self.model)
        self.eos_token_ids = eos_token_ids(self.model_path, hf_config)
        self.weights_version = weights_version(self.model_path)
        self.versions: dict[str, ModelVersion] = {}

    def _draft_kv_share(self, draft_model: str) -> float:
        """The draft model's part of the KV budget: its pool has as many blocks as the
        target's, so the budget is split by their bytes per block."""
        if not draft_model:
            return 0.0
        draft = LlamaConfig.from_hf(read_hf_config(draft_model))
        mine = self.config.num_layers * self.config.num_kv_heads * self.config.head_dim
        theirs = draft.num_layers * draft.num_kv_heads * draft.head_dim
        return theirs / (mine + theirs)

    def _init_kv_cache(
        self, memory_gib: float, num_blocks: int | None, gpu_memory_utilization: float,
        share: float = 1.0,
    ) -> None:
        """The target's pool: `share` of the KV budget (the rest is the draft model's)."""
        layout = dict(
            num_layers=self.config.num_layers,
            block_size=self.block_size,
            num_kv_heads=self.config.num_kv_heads,
            head_dim=self.config.head_dim,
            dtype=self.dtype,
            device=self.device,
        )
        if num_blocks is not None:
            self.kv_cache = KVCache(num_blocks=num_blocks, **layout)  # type: ignore[arg-type]
        else:
            if self.device.type == "cuda":
                budget = int(cuda_kv_budget_bytes(self.device, gpu_memory_utilization) * share)
            else:
                budget = int(memory_gib * GIB * share)
            self.kv_cache = KVCache.from_budget(budget, **layout)  # type: ignore[arg-type]
        self.num_blocks = self.kv_cache.num_blocks

    def model_info(self) -> dict[str, Any]:
        """What the worker tells the scheduler at start-up (the Ready message's info)."""
        return {
            "model_type": self.config.model_type,
            "num_layers": self.config.num_layers,
            "num_kv_heads": self.config.num_kv_heads,
            "head_dim": self.config.head_dim,
            "dtype": str(self.dtype).removeprefix("torch."),
            "num_blocks": self.num_blocks,
            "block_size": self.block_size,
            "max_model_len": self.max_model_len,
            "vocab_size": self.config.vocab_size,
            "eos_token_ids": list(self.eos_token_ids),
            "weights_version": self.weights_version,
            "num_host_blocks": self.num_host_blocks,
            "device": str(self.device),
            "speculative": self.speculative,
        }

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
            raise IncompatibleModel(f"{path} has KV layout (layers, kv heads, head dim) {want}, "
                                    f"the pool holds {have}: swap it in drain mode")
        version = version or weights_version(path)
        if version in self.versions:
            raise ValueError(f"model version {version!r} is already loaded")
        backend = create_backend(self.backend.name, num_heads=config.num_heads,
                                 num_kv_heads=config.num_kv_heads, head_dim=config.head_dim,
                                 dtype=self.dtype, device=self.device)
        model = load_model(path, backend, dtype=self.dtype, device=self.device,
                           max_positions=self.max_model_len)
        graphs = maybe_capture_graphs(
            model, backend, self.kv_cache.tensor, block_size=self.block_size,
            max_model_len=self.max_model_len, enforce_eager=self.graphs is None,
            max_graph_batch_size=getattr(self.graphs, "max_batch_size", 0))
        self.versions[version] = ModelVersion(model, graphs, config, path,
                                              eos_token_ids(path, hf_config))
        return version

    def set_default_version(self, version: str) -> None:
        """New requests without an explicit version run on `version` from now on."""
        loaded = self.versions[version]
        self.default_version = version
        self.model, self.graphs, self.config = loaded.model, loaded.graphs, loaded.config
        self.model_path, self.weights_version = loaded.path, version
        self.eos_token_ids = loaded.eos_token_ids

    def unload_version(self, version: str) -> None:
        """Free a version's weights once no request uses it."""
        if version == self.default_version:
            raise ValueError(f"version {version!r} is the default; switch first")
        users = [r for r, st in self._requests.items() if st.version == version]
        if users:
            raise ValueError(f"version {version!r} still serves {len(users)} requests")
        del self.versions[version]

    def num_requests(self) -> int:
        return len(self._requests)

    def drop(self, req_id: str) -> None:
        """Forget a request (idempotent), e.g. after its step failed."""
        self._requests.pop(req_id, None)

    def execute(self, plan: StepPlan) -> StepResult:
        """Apply the plan's diffs, run its batch, and return the sampled tokens."""
        start = time.perf_counter()
        self._apply_diffs(plan)
        if not plan.req_ids:
            return StepResult(step_id=plan.step_id, req_ids=[], token_ids=[])
        sampled: dict[str, list[int]] = {}
        proposed: dict[str, int] = {}
        for version, indices in self._by_version(plan).items():  # one forward per version
            batch = self._prepare_batch(plan, indices)
            loaded = self.versions[version]
            with torch.inference_mode():
                logits = run_model(loaded.model, loaded.graphs, batch.input_ids,
                                   self.kv_cache.tensor, batch.meta, batch.logits_indices)
                for rid, tokens in zip(batch.sampling_req_ids, self._accept(logits, batch),
                                       strict=True):
                    sampled[rid] = tokens
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
            forward_s=time.perf_counter() - start,
        )

    def _accept(self, logits: torch.Tensor, batch: _Batch) -> list[list[int]]:
        """Each sampling request's tokens: one sampled, or its verified drafts plus one.
        A verified request's accepted drafts count as computed; the blocks past them (only
        rejected drafts' slots) leave its table, as they leave the scheduler's."""
        states = batch.sampling_states
        if not any(batch.spec_slots):  # no speculation: one logits row each, sampled at once
            tokens = sample(logits, [s.params for s in states], [s.generator for s in states])
            for state, token in zip(states, tokens, strict=True):
                state.token_ids.append(token)
            return [[t] for t in tokens]
        first = list(itertools.accumulate((1 + len(d) for d in batch.drafts), initial=0))
        plain = [j for j, slots in enumerate(batch.spec_slots) if not slots]
        out: list[list[int]] = [[] for _ in states]
        if plain:
            tokens = sample(logits[[first[j] for j in plain]],
                            [states[j].params for j in plain],
                            [states[j].generator for j in plain])
            for j, token in zip(plain, tokens, strict=True):
                out[j] = [token]
        for j, state in enumerate(states):
            if batch.spec_slots[j]:
                verdict = verify(logits[first[j]:first[j + 1]], batch.drafts[j], state.params,
                                 state.generator, batch.draft_probs[j])
                out[j] = verdict.tokens
                state.num_computed += verdict.num_accepted
                del state.block_table[-(-state.num_computed // self.block_size):]
                state.draft_computed = min(batch.draft_computed[j], state.num_computed)
            state.token_ids.extend(out[j])
        return out

    def _by_version(self, plan: StepPlan) -> dict[str, list[int]]:
        groups: dict[str, list[int]] = {}
        for i, rid in enumerate(plan.req_ids):
            state = self._requests.get(rid)
            version = state.version if state is not None else self.default_version
            groups.setdefault(version, []).append(i)
        return groups

    def _apply_diffs(self, plan: StepPlan) -> None:
        for req_id in plan.finished_req_ids:
            self._requests.pop(req_id, None)  # idempotent: a repeat or unknown id is fine
        if plan.swap_out_src:  # before anything can overwrite the blocks being saved
            self.kv_cache.swap_out(plan.swap_out_src, plan.swap_out_dst)
        for req_id in plan.preempted_req_ids:
            state = self._requests[req_id]
            state.block_table = []
            state.num_computed = 0
            state.draft_computed = 0  # swaps and recomputes restore only the target's KV
        versions = plan.new_versions or [""] * len(plan.new_req_ids)
        new = zip(plan.new_req_ids, plan.new_prompt_token_ids, plan.new_sampling, versions,
                  strict=True)
        for req_id, prompt, params, version in new:
            if req_id in self._requests:
                raise ValueError(f"request {req_id} is already running on the worker")
            if not prompt:
                raise ValueError(f"request {req_id} has an empty prompt")
            generator = make_generator(params, self._rng, self.device)
            version = version or self.default_version
            if version not in self.versions:
                raise ValueError(f"request {req_id} wants model version {version!r}, loaded: "
                                 f"{sorted(self.versions)}")
            self._requests[req_id] = RequestState(list(prompt), params, generator,
                                                  version=version)
        if plan.swap_in_src:
            self.kv_cache.swap_in(plan.swap_in_src, plan.swap_in_dst)
        if plan.copy_src:
            self.kv_cache.copy_blocks(plan.copy_src, plan.copy_dst)
            for req_id, index, dst in zip(plan.copy_req_ids, plan.copy_index, plan.copy_dst,
                                          strict=True):
                state = self._requests[req_id]
                if index < len(state.block_table):  # else the table arrives whole, this step
                    state.block_table[index] = dst
                # the copy is the target's KV only: the draft pool restarts before the block
                state.draft_computed = min(state.draft_computed, index * self.block_size)

    def _prepare_batch(self, plan: StepPlan, indices: list[int]) -> _Batch:
        """The packed inputs of the scheduled requests `indices` (one model version)."""
        num_reqs = len(plan.req_ids)
        if not (
            len(plan.num_computed_tokens)
            == len(plan.num_new_tokens)
            == len(plan.new_block_ids)
            == num_reqs
        ):
            raise ValueError(f"step {plan.step_id}: batch fields differ in length")
        if len(set(plan.req_ids)) != num_reqs:
            raise ValueError(f"step {plan.step_id}: a request is scheduled twice")
        slots = plan.num_spec_tokens or [0] * num_reqs
        if len(slots) != num_reqs:
            raise ValueError(f"step {plan.step_id}: batch fields differ in length")
        states = {i: self._schedule(plan, i, slots[i]) for i in indices}
        drafts, draft_probs, draft_computed = self._propose(plan, indices, states, slots)
        # decodes first (stable), so the backend sees them as one contiguous batch
        num_new = {i: plan.num_new_tokens[i] + len(drafts[i]) for i in indices}
        order = sorted(indices, key=lambda i: num_new[i] != 1)
        input_ids: list[int] = []
        first_row: dict[int, int] = {}  # packed index of the request's last known token
        for i in order:
            num_computed = plan.num_computed_tokens[i]
            input_ids.extend(states[i].token_ids[num_computed:num_computed
                                                 + plan.num_new_tokens[i]])
            first_row[i] = len(input_ids) - 1
            input_ids.extend(drafts[i])
        meta = build_metadata(
            [plan.num_computed_tokens[i] for i in order],
            [num_new[i] for i in order],
            [states[i].block_table for i in order],
            self.block_size,
            self.device,
        )
        for i in order:
            states[i].num_computed += plan.num_new_tokens[i]  # drafts count once accepted
        sampling = [i for i in indices if self._samples(plan.req_ids[i])]
        logits_indices = [k for i in sampling
                          for k in range(first_row[i], first_row[i] + 1 + len(drafts[i]))]
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
        )

    def _propose(
        self, plan: StepPlan, indices: list[int], states: dict[int, RequestState],
        slots: list[int],
    ) -> tuple[dict[int, list[int]], dict[int, torch.Tensor | None], dict[int, int]]:
        """Draft tokens for the requests given draft slots (decodes of their last token)."""
        drafts: dict[int, list[int]] = {i: [] for i in indices}
        probs: dict[int, torch.Tensor | None] = {i: None for i in indices}
        computed = {i: states[i].draft_computed for i in indices}
        spec = [i for i in indices if slots[i]]
        for i in spec:
            if plan.num_computed_tokens[i] + plan.num_new_tokens[i] != len(states[i].token_ids):
                raise ValueError(f"request {plan.req_ids[i]}: draft slots on a step that does "
                                 "not reach its last token")
        if not spec or not self.speculative:
            return drafts, probs, computed
        if self.drafter is None:  # n-gram lookup in the request's own tokens
            for i in spec:
                drafts[i] = ngram_propose(states[i].token_ids, slots[i], *self.prompt_lookup)
            return drafts, probs, computed
        got, q, after = self.drafter.propose(
            [states[i].token_ids for i in spec], [states[i].draft_computed for i in spec],
            [states[i].block_table for i in spec], [slots[i] for i in spec],
            [states[i].params for i in spec], [states[i].generator for i in spec])
        for j, i in enumerate(spec):
            drafts[i], probs[i], computed[i] = got[j], q[j], after[j]
        return drafts, probs, computed

    def _samples(self, req_id: str) -> bool:
        """After this step's tokens are counted: has the request computed all it knows?"""
        state = self._requests[req_id]
        return state.num_computed == len(state.token_ids)

    def _schedule(self, plan: StepPlan, i: int, num_spec: int = 0) -> RequestState:
        """Check the plan's view of request i against ours; append its new blocks."""
        req_id = plan.req_ids[i]
        state = self._requests.get(req_id)
        if state is None:
            raise ValueError(f"step {plan.step_id}: unknown request {req_id}")
        num_computed, num_new = plan.num_computed_tokens[i], plan.num_new_tokens[i]
        if not state.block_table and num_computed <= len(state.token_ids):
            # new or preempted: KV it starts with comes from prefix hits, a fork or a swap-in
            state.num_computed = num_computed
        if num_computed != state.num_computed:
            raise ValueError(
                f"request {req_id}: plan says {num_computed} tokens computed, worker has "
                f"{state.num_computed}"
            )
        end = num_computed + num_new
        if num_new < 1 or end > len(state.token_ids) or end > self.max_model_len:
            raise ValueError(
                f"request {req_id}: cannot compute tokens [{num_computed}, {end}) of "
                f"{len(state.token_ids)} known (max_model_len {self.max_model_len})"
            )
        bad = [b for b in plan.new_block_ids[i] if not 0 <= b < self.num_blocks]
        if bad:
            raise ValueError(f"request {req_id}: block ids {bad} outside [0, {self.num_blocks})")
        state.block_table.extend(plan.new_block_ids[i])
        if num_spec and (end + num_spec > self.max_model_len
                         or len(state.block_table) * self.block_size < end + num_spec):
            raise ValueError(f"request {req_id}: {num_spec} draft slots after token {end} do "
                             f"not fit its {len(state.block_table)} blocks or max_model_len")
        return state
