"""Structs that travel inside messages of more than one connection."""

from __future__ import annotations

import dataclasses
import enum

from common.codec import struct


class FinishReason(enum.IntEnum):
    """Why a request ended; int on the wire, OpenAI's string at the edge."""

    NONE = 0
    STOP = 1  # EOS token or a stop string
    LENGTH = 2  # max_tokens or the model length
    CANCELLED = 3
    TIMEOUT = 4
    ERROR = 5

    @property
    def openai(self) -> str | None:
        return _OPENAI_NAMES[self]


_OPENAI_NAMES = {
    FinishReason.NONE: None,
    FinishReason.STOP: "stop",
    FinishReason.LENGTH: "length",
    FinishReason.CANCELLED: "cancelled",
    FinishReason.TIMEOUT: "timeout",
    FinishReason.ERROR: "error",
}


# SamplingParams fields a model's generation_config.json may give defaults for, used when a
# request leaves them unset (vLLM's --generation-config auto)
MODEL_DEFAULT_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")

# SamplingParams.structured_kind: what structured_spec holds
STRUCTURED_KINDS = ("json", "json_object", "regex", "choice", "grammar")

# SamplingParams.pooling of an embeddings request (vLLM's pooling types): the hidden state of
# the last prompt token, or the mean over every prompt token
POOLING_KINDS = ("last", "mean")


@struct
class SamplingParams:
    """How one request samples and when it stops. Validated by the gateway and tokenizer."""

    max_tokens: int = 16
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0  # (0, 1]
    top_k: int = 0  # 0 = off
    seed: int | None = None  # reproducible sampling when set
    stop: list[str] = dataclasses.field(default_factory=list)  # stop strings, not emitted
    include_stop_str_in_output: bool = False  # vLLM's: emit the stop string that ended it
    skip_special_tokens: bool = True  # vLLM's: special tokens are left out of the text
    stop_token_ids: list[int] = dataclasses.field(default_factory=list)
    ignore_eos: bool = False
    n: int = 1  # sequences per request; they share the prompt's KV blocks
    min_p: float = 0.0  # [0, 1]: drop tokens less likely than min_p * the top probability
    # logits controls, applied before sampling (and before a greedy argmax):
    presence_penalty: float = 0.0  # [-2, 2], once per token already generated
    frequency_penalty: float = 0.0  # [-2, 2], times the token's count in the output
    repetition_penalty: float = 1.0  # > 0, on tokens of the prompt or the output; 1 = off
    # logit_bias as struct-of-arrays: logit_bias_values[j] is added to token
    # logit_bias_token_ids[j] (OpenAI's {"id": bias} map; bias in [-100, 100])
    logit_bias_token_ids: list[int] = dataclasses.field(default_factory=list)  # [b]
    logit_bias_values: list[float] = dataclasses.field(default_factory=list)  # [b]
    min_tokens: int = 0  # EOS and stop_token_ids are masked until this many are generated
    # vLLM's allowed_token_ids: only these may be generated (empty: any)
    allowed_token_ids: list[int] = dataclasses.field(default_factory=list)  # [a]
    bad_words: list[str] = dataclasses.field(default_factory=list)  # as the client sent them
    # bad_words as token-id sequences (the tokenizer fills it): a sequence's last token is
    # banned when the rest of it ends the output; a one-token sequence is always banned
    bad_words_token_ids: list[list[int]] = dataclasses.field(default_factory=list)  # [w][*]
    # logprobs from the model's raw distribution (log_softmax of the logits before any
    # control or temperature, vLLM's default): the top `logprobs` of each output token and
    # the sampled token's own (None = off; 0 = the sampled token's only), and the same for
    # every prompt token after the first (`prompt_logprobs`, vLLM's extension)
    logprobs: int | None = None  # [0, 20]
    prompt_logprobs: int | None = None  # [0, 20]
    # structured outputs (gpu_worker/sample/structured.py): the output must match a grammar of
    # `structured_kind` (STRUCTURED_KINDS; "" = free text) given by `structured_spec` (a JSON
    # schema's text, a regex, an EBNF grammar, or a JSON list of choices); a compile error
    # names `structured_field`, the request field the spec came from
    structured_kind: str = ""
    structured_spec: str = ""
    structured_field: str = ""
    # the grammar starts after this text ends the output's reasoning (a reasoning parser's
    # "</think>"; "": at the first token), and after these ids, the tokenizer's for it
    structured_after: str = ""
    structured_after_ids: list[int] = dataclasses.field(default_factory=list)
    # embeddings (POOLING_KINDS): "" generates; "last" / "mean" computes the prompt only and
    # finishes with its pooled final-normed hidden states instead of a token
    pooling: str = ""

    @property
    def is_structured(self) -> bool:
        """The output is constrained by a grammar (no draft slots: drafts are not checked
        against it)."""
        return bool(self.structured_kind)

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    @property
    def has_penalties(self) -> bool:
        """Penalties that read the request's token counts."""
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
        )

    @property
    def wants_logprobs(self) -> bool:
        """Output tokens' logprobs: such a request gets no draft slots (the worker reports
        logprobs for sampled rows only, not for verified drafts)."""
        return self.logprobs is not None

    @property
    def has_controls(self) -> bool:
        """Logits controls (penalties, logit_bias, min_tokens, bad words, allowed token ids)
        that change the logits before sampling, greedy or not. (min_p, like top_p, filters
        sampling only.)"""
        return (
            self.has_penalties
            or bool(self.logit_bias_token_ids)
            or self.min_tokens > 0
            or bool(self.bad_words_token_ids)
            or bool(self.allowed_token_ids)
        )


@struct
class ModelInfo:
    """What a worker tells the scheduler about the model it serves and its KV pool: in its
    Ready (at start-up, and after a Reset) and in ModelLoaded (after a swap). The runner fills
    the model and pool fields; the worker adds where the model came from and who it is."""

    model_type: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str  # "float32" | "bfloat16"
    num_blocks: int  # KV blocks in the pool
    block_size: int  # tokens per block
    max_model_len: int
    vocab_size: int  # 0: unknown (token ids are not checked)
    eos_token_ids: list[int]
    weights_version: str
    num_host_blocks: int = 0  # host-memory blocks for swapped-out KV
    # the prefix cache's lower tiers (--kv-offload-memory, --kv-offload-dir): host slots,
    # the blocks the disk budget holds, bytes of one block (this rank's shard), and the
    # blocks already on disk (found at start-up: they outlive a restart), key and tokens
    num_tier_host_blocks: int = 0
    num_tier_disk_blocks: int = 0
    tier_block_bytes: int = 0
    tier_disk_keys: list[int] = dataclasses.field(default_factory=list)  # [n]
    tier_disk_tokens: list[list[int]] = dataclasses.field(default_factory=list)  # [n][bs]
    tier_store_id: str = ""  # a new id: the worker's tiers were rebuilt (start, drain swap)
    kv_pool_id: str = ""  # a new id: the worker allocated a new KV pool (start, drain swap),
    # whose blocks hold nothing: the scheduler's prefix cache of the old pool is forgotten
    kv_cache_dtype: str = ""  # how KV rows are stored: the float dtype, int8, fp8_e4m3, fp8_e5m2
    # KV layer groups (common/kv_groups.py): each group's window (0: the whole context),
    # one block table per group in the scheduler; empty: one dense group (no windows)
    kv_group_windows: list[int] = dataclasses.field(default_factory=list)
    device: str = ""
    speculative: str = ""  # the speculative method, "" = off
    tensor_parallel_size: int = 1
    weight_bytes: int = 0  # the model's weights resident in the worker (this rank's shard)
    quantization: str = ""  # how its linears are stored: "" (float), "int8", "gguf:Q4_1+Q8_0"
    # LoRA (--enable-lora; 0 / empty: off): adapters one step may use, the rank limit, and
    # the adapters loaded now (at start: --lora-modules), one entry each, in loading order
    max_loras: int = 0
    max_lora_rank: int = 0
    lora_names: list[str] = dataclasses.field(default_factory=list)  # [num_loras]
    lora_paths: list[str] = dataclasses.field(default_factory=list)  # [num_loras] folders
    # [num_loras] sha256 of each adapter's config + weights (enters the prefix cache's root)
    lora_weights_hashes: list[str] = dataclasses.field(default_factory=list)
    lora_ranks: list[int] = dataclasses.field(default_factory=list)  # [num_loras]
    # the worker's additions
    model_name: str = ""  # the served model's name
    model_path: str = ""  # its folder (tokenizer files, for the tokenizer processes)
    tokenizer_fingerprint: str = ""
    position_config: str = ""  # rope/position settings, part of the prefix cache's root
    pid: int = 0
    boot_id: str = ""  # unique per process start (a restarted container keeps pid 1)
