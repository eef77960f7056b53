"""Request intake: whether a tokenised request may be admitted, and its sequences.

A request's sequences are keyed for the policy and the worker by `sequence_key(id, index)`,
which is built here and never parsed: messages to the detokenizer carry the request id and
the index side by side.
"""

from __future__ import annotations

import dataclasses

from common.messages import TokenizedRequest
from common.model_facts import lora_root, salted_root
from services.scheduler.current_model import CurrentModel
from services.scheduler.lora_registry import Adapter, Refusal
from services.scheduler.request import Request


def sequence_key(request_id: str, index: int) -> str:
    """The policy's and the worker's key of sequence `index` of a request. Injective (the
    index comes first, before the first '/'), so client ids need no escaping."""
    return f"{index}/{request_id}"


def admission_error(
    msg: TokenizedRequest,
    served: CurrentModel,
    num_waiting: int,
    max_waiting: int,
    is_duplicate: bool,
) -> Refusal | None:
    """Why `msg` cannot be admitted (the queue is full, its prompt is too long or holds an
    id outside the vocabulary, its id is taken, a resume it cannot take), or None."""
    if num_waiting >= max_waiting:
        return (
            429,
            f"server overloaded: {num_waiting} requests waiting "
            f"(max_waiting={max_waiting}); retry later",
            None,
        )
    # (an embeddings request generates nothing: its prompt may fill the model's length)
    longest = served.max_model_len - (0 if msg.sampling.pooling else 1)
    if len(msg.prompt_token_ids) > longest:
        return (
            400,
            f"prompt: the prompt has {len(msg.prompt_token_ids)} tokens; this server "
            f"holds at most {longest}",
            "prompt",  # the request's prompt: the gateway names the endpoint's field
        )
    if served.vocab_size:
        bad = next((t for t in msg.prompt_token_ids if not 0 <= t < served.vocab_size), None)
        if bad is not None:
            return (
                400,
                f"token id {bad} is outside the vocabulary of model version "
                f"{served.version} (ids must be in [0, {served.vocab_size}))",
                "prompt",
            )
    if is_duplicate:
        return (400, f"request id {msg.request_id!r} is already in flight", "X-Request-Id")
    if msg.resumed_token_ids and (
        msg.sampling.n != 1
        or len(msg.prompt_token_ids) + len(msg.resumed_token_ids)
        >= min(served.max_model_len, len(msg.prompt_token_ids) + msg.sampling.max_tokens)
    ):
        return (503, "the request cannot be resumed here; retry it", None)
    return None


def sequences(
    msg: TokenizedRequest, served: CurrentModel, adapter: Adapter | None = None
) -> list[Request]:
    """One Request per sequence: a leader, and for n > 1 n - 1 forks sharing its prompt."""
    lora_name, lora_hash = (adapter.name, adapter.weights_hash) if adapter else ("", "")
    root = lora_root(salted_root(served.root, msg.cache_salt), lora_name, lora_hash)
    seqs: list[Request] = []
    for i in range(msg.sampling.n):
        sampling = msg.sampling
        if sampling.seed is not None and i:
            sampling = dataclasses.replace(sampling, seed=sampling.seed + i)
        seqs.append(
            Request(
                sequence_key(msg.request_id, i),
                msg.prompt_token_ids,
                sampling,
                msg.eos_token_ids,
                max_model_len=served.max_model_len,
                arrival_time=msg.arrival_time,
                cache_root=root,
                cache_salt=msg.cache_salt,
                lora_name=lora_name,
                lora_hash=lora_hash,
                priority=msg.priority,
                timeout=msg.timeout,
                fork_of=seqs[0] if i else None,
                group_id=msg.request_id,
                seq_index=i,
            )
        )
    # a resumed request: its outputs so far are known tokens without KV, as after a
    # preemption by recompute (the admission allows it only with one sequence)
    seqs[0].output_token_ids = list(msg.resumed_token_ids)
    return seqs
