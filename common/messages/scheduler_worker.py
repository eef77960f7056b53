"""scheduler <-> worker: step plans as diffs, and their sampled tokens.

A request's prompt and sampling parameters travel once (`new_*`); afterwards a step names
only what changed. The worker keeps per request: all token ids (prompt + sampled), its
block table, and how many tokens are in the KV cache. For each scheduled request it
computes `token_ids[num_computed : num_computed + num_new]`; if that reaches the end of the
known tokens, it samples one token and appends it. With speculative decoding a decode also
gets `num_spec_tokens` slots: the worker proposes that many draft tokens, verifies them in
the same forward, and returns the accepted ones plus one; rejected slots are rolled back
(both sides cut the block table to the blocks the computed tokens use).

    block table of a request, block_size 4, 10 tokens computed:
    [ b7 | b2 | b9 ]   slots: b7*4+0..3, b2*4+0..3, b9*4+0..1 used
"""

from __future__ import annotations

import dataclasses

from common.codec import message
from common.messages.types import ModelInfo, SamplingParams


@message("step_plan")
class StepPlan:
    step_id: int
    # requests the worker has not seen yet, in any order
    new_req_ids: list[str] = dataclasses.field(default_factory=list)  # [num_new]
    new_prompt_token_ids: list[list[int]] = dataclasses.field(default_factory=list)  # [num_new][*]
    new_sampling: list[SamplingParams] = dataclasses.field(default_factory=list)  # [num_new]
    new_versions: list[str] = dataclasses.field(default_factory=list)  # [num_new] model version
    # ("" or absent: the worker's default version)
    # the LoRA adapter each new request runs with, by name ("": the base model); absent when
    # no new request of the step has one (the worker has the adapter: LoadLora came first)
    new_loras: list[str] = dataclasses.field(default_factory=list)  # [num_new]
    # the tokens that end each new request (stop_token_ids, EOS unless ignore_eos) when it has
    # min_tokens: the worker masks them until min_tokens are out; [] for the others, and
    # absent when no new request has min_tokens
    new_stop_token_ids: list[list[int]] = dataclasses.field(default_factory=list)  # [num_new][*]
    # how many of each new request's token ids are outputs already sampled (a request resumed
    # after a process died): its seeded generator is advanced past them and penalties count
    # them as outputs; absent when no new request of the step has any
    new_num_output_tokens: list[int] = dataclasses.field(default_factory=list)  # [num_new]
    # requests to forget before this step runs (finished, cancelled)
    finished_req_ids: list[str] = dataclasses.field(default_factory=list)
    # requests whose KV was dropped (recompute preemption): block table and count reset to 0,
    # token ids kept; they come back later with num_computed_tokens == 0
    preempted_req_ids: list[str] = dataclasses.field(default_factory=list)
    # the batch, in order
    req_ids: list[str] = dataclasses.field(default_factory=list)  # [num_reqs]
    num_computed_tokens: list[int] = dataclasses.field(default_factory=list)  # [num_reqs]
    num_new_tokens: list[int] = dataclasses.field(default_factory=list)  # [num_reqs]
    new_block_ids: list[list[int]] = dataclasses.field(default_factory=list)  # [num_reqs][*]
    # KV layer groups (ModelInfo.kv_group_windows): each group's new entries, -1 where a
    # sliding group's block went back (never read: out of the window); new_block_ids is
    # then the reference group's. Empty: one dense group
    new_group_block_ids: list[list[list[int]]] = dataclasses.field(default_factory=list)
    # speculative decoding: slots for up to this many draft tokens after a decode's token
    # (the worker proposes them and verifies them in this step's forward); empty: none
    num_spec_tokens: list[int] = dataclasses.field(default_factory=list)  # [num_reqs]
    # (a request whose table is empty on the worker, new or preempted, gets its whole table
    # here, and its num_computed_tokens is taken as given: prefix hits, forks, swap-ins)
    # KV copies, done before the step computes, in this order:
    swap_out_src: list[int] = dataclasses.field(default_factory=list)  # [n] device blocks
    swap_out_dst: list[int] = dataclasses.field(default_factory=list)  # [n] host blocks
    swap_in_src: list[int] = dataclasses.field(default_factory=list)  # [m] host blocks
    swap_in_dst: list[int] = dataclasses.field(default_factory=list)  # [m] device blocks
    # copy-on-write: request copy_req_ids[j] replaces table[copy_index[j]] (block
    # copy_src[j], shared) by copy_dst[j], a private copy of it
    copy_req_ids: list[str] = dataclasses.field(default_factory=list)  # [c]
    copy_index: list[int] = dataclasses.field(default_factory=list)  # [c]
    copy_src: list[int] = dataclasses.field(default_factory=list)  # [c]
    copy_dst: list[int] = dataclasses.field(default_factory=list)  # [c]
    copy_groups: list[int] = dataclasses.field(default_factory=list)  # [c] with layer groups
    # the prefix cache's lower tiers (host slots and files, keyed by the block's hash chain
    # key, version root included); the worker does them before the step computes, in this
    # order: drops, spills, fetches, saves; then (after swap_out) loads. Absent: none.
    # files to delete (evicted from the disk tier)
    tier_drop_keys: list[int] = dataclasses.field(default_factory=list)  # [d]
    # host slot -> file (evicted from the host tier; written in the background)
    tier_spill_slots: list[int] = dataclasses.field(default_factory=list)  # [s]
    tier_spill_keys: list[int] = dataclasses.field(default_factory=list)  # [s]
    tier_spill_tokens: list[list[int]] = dataclasses.field(default_factory=list)  # [s][bs]
    # file -> host slot, checked (key, tokens, layout, checksum); answered in the result
    tier_fetch_keys: list[int] = dataclasses.field(default_factory=list)  # [f]
    tier_fetch_tokens: list[list[int]] = dataclasses.field(default_factory=list)  # [f][bs]
    tier_fetch_slots: list[int] = dataclasses.field(default_factory=list)  # [f]
    # device block -> host slot (a full cached block evicted from the pool)
    tier_save_src: list[int] = dataclasses.field(default_factory=list)  # [v] device blocks
    tier_save_dst: list[int] = dataclasses.field(default_factory=list)  # [v] host slots
    # host slot -> device block (a prefix hit in host memory)
    tier_load_src: list[int] = dataclasses.field(default_factory=list)  # [l] host slots
    tier_load_dst: list[int] = dataclasses.field(default_factory=list)  # [l] device blocks
    # prefill/decode hand-over (gpu_worker/kv_handover.py), before the step computes, in the
    # tier files' format (header: layout, key, tokens, version; checksum). A prefill replica
    # exports full blocks of a request it hands over: to a file (shm), or, where the path
    # is "", as bytes in the result (tcp)
    kv_export_src: list[int] = dataclasses.field(default_factory=list)  # [e] device blocks
    kv_export_keys: list[int] = dataclasses.field(default_factory=list)  # [e] chain hashes
    kv_export_tokens: list[list[int]] = dataclasses.field(default_factory=list)  # [e][bs]
    kv_export_versions: list[str] = dataclasses.field(default_factory=list)  # [e]
    kv_export_paths: list[str] = dataclasses.field(default_factory=list)  # [e] "": in result
    # a decode replica imports them into fresh device blocks: from a file, or from the bytes
    # here (base64, tcp) where the path is ""; each is checked against key, tokens, layout,
    # version and checksum, and one that does not match is not written (answered failed)
    kv_import_dst: list[int] = dataclasses.field(default_factory=list)  # [i] device blocks
    kv_import_keys: list[int] = dataclasses.field(default_factory=list)  # [i]
    kv_import_tokens: list[list[int]] = dataclasses.field(default_factory=list)  # [i][bs]
    kv_import_versions: list[str] = dataclasses.field(default_factory=list)  # [i]
    kv_import_paths: list[str] = dataclasses.field(default_factory=list)  # [i]
    kv_import_data: list[str] = dataclasses.field(default_factory=list)  # [i] base64 or ""

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new_tokens)


@message("step_result")
class StepResult:
    step_id: int
    req_ids: list[str]  # [num_sampled] requests that sampled a token this step
    token_ids: list[int]  # [sum(num_tokens)] their tokens, request after request
    # speculative decoding: tokens each request produced (accepted drafts + 1) and drafts it
    # proposed; empty: one token each, nothing proposed
    num_tokens: list[int] = dataclasses.field(default_factory=list)  # [num_sampled]
    num_proposed: list[int] = dataclasses.field(default_factory=list)  # [num_sampled]
    # logprobs (SamplingParams.logprobs), token by token as token_ids: entry 0 is the
    # sampled token, then the top k of the raw distribution, best first; [] for a token of
    # a request that did not ask, and empty lists when no request of the step asked
    logprob_token_ids: list[list[int]] = dataclasses.field(default_factory=list)  # [sum][1+k]
    logprob_values: list[list[float]] = dataclasses.field(default_factory=list)  # [sum][1+k]
    # prompt logprobs (SamplingParams.prompt_logprobs), sent once, with a request's first
    # sampled token: one entry per prompt token as above, entry 0 the prompt's first token
    # alone with no value ([tok0], []: nothing precedes it); [] for the other requests
    prompt_logprob_token_ids: list[list[list[int]]] = dataclasses.field(default_factory=list)
    # [num_sampled][num_prompt][1+k]
    prompt_logprob_values: list[list[list[float]]] = dataclasses.field(default_factory=list)
    # [num_sampled][num_prompt][1+k]
    # each prompt token's rank (1 = most likely; 0 for the first token), in or out of the top k
    prompt_logprob_ranks: list[list[int]] = dataclasses.field(default_factory=list)
    # [num_sampled][num_prompt]
    # embeddings (SamplingParams.pooling): requests whose prompt's last chunk ran this step
    # and their pooled final-normed hidden states (float32, not normalised); they sampled
    # nothing and are done
    pooled_req_ids: list[str] = dataclasses.field(default_factory=list)  # [num_pooled]
    embeddings: list[list[float]] = dataclasses.field(default_factory=list)  # [num_pooled][H]
    # the plan's tier fetches: keys now in their host slots, and keys discarded (a missing,
    # unreadable or corrupted file, or one whose header does not match its key)
    tier_fetched_keys: list[int] = dataclasses.field(default_factory=list)  # [ok]
    tier_fetch_failed_keys: list[int] = dataclasses.field(default_factory=list)  # [failed]
    # the plan's hand-over: exported blocks' bytes where no path was given (base64, plan
    # order; [] when none), and the import destinations not written (a block that failed
    # its checks: its tokens are recomputed)
    kv_export_data: list[str] = dataclasses.field(default_factory=list)  # [e]
    kv_import_failed_dst: list[int] = dataclasses.field(default_factory=list)  # [failed]
    forward_s: float = 0.0  # worker time for the step, model + sampling
    # a mixture of experts: (token, expert) pairs each expert computed this step, summed over
    # the model's MoE layers (routing skew, /admin/stats); empty for a dense model
    expert_tokens: list[int] = dataclasses.field(default_factory=list)  # [num_experts]
    error: str = ""  # set when the step failed: its requests are failed, not retried


@message("kv_exported")
class KvExported:
    """worker -> scheduler: a plan's hand-over exports are written, before its step runs
    (they are read first): its hand-overs may leave now, overlapped with the step, rather
    than with the step's result. `data` as StepResult.kv_export_data."""

    step_id: int
    data: list[str] = dataclasses.field(default_factory=list)


@message("load_model")
class LoadModel:
    """scheduler -> worker: load a model version. `overlap`: beside the served ones (same KV
    layout); `drain`: replace everything (the scheduler has drained all requests first)."""

    path: str
    version: str  # "" = a hash of the weight files
    mode: str  # overlap | drain


@message("model_loaded")
class ModelLoaded:
    """worker -> scheduler: the answer to LoadModel; `error` set when it failed (the old
    model goes on serving). `model` describes the new version; on error, the old one when a
    failed drain rebuilt it (on a new KV pool), else None."""

    version: str
    model: ModelInfo | None = None
    error: str = ""


@message("unload_model")
class UnloadModel:
    version: str


@message("compile_grammar")
class CompileGrammar:
    """scheduler -> worker: compile a request's grammar (SamplingParams.structured_*) for the
    tokenizer `tokenizer_fingerprint` ("": the default version's), off the step loop. The
    scheduler holds the request out of its queues until the answer comes."""

    request_id: str
    kind: str
    spec: str
    tokenizer_fingerprint: str = ""


@message("grammar_compiled")
class GrammarCompiled:
    """worker -> scheduler: the answer to CompileGrammar; `error` set when the spec does not
    compile (the request is refused with a 400 naming its field)."""

    request_id: str
    error: str = ""
    # the CompileGrammar's: a request tokenised again for another tokenizer meanwhile is
    # not released by the answer for the old one
    tokenizer_fingerprint: str = ""


@message("load_lora")
class LoadLora:
    """scheduler -> worker: read a PEFT adapter folder and keep it (CPU-side cache) under
    `name`; a name already loaded is replaced (its requests must have finished)."""

    name: str
    path: str


@message("lora_loaded")
class LoraLoaded:
    """worker -> scheduler: the answer to LoadLora. `weights_hash` identifies the adapter's
    weights (it enters the prefix cache's root); `error` names the file and field when the
    adapter is refused (nothing is loaded then)."""

    name: str
    weights_hash: str = ""
    rank: int = 0
    error: str = ""


@message("unload_lora")
class UnloadLora:
    """scheduler -> worker: forget an adapter (no running request uses it)."""

    name: str
