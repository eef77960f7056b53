"""Speculative decoding on the worker: drafters that propose tokens, and their verification.

A decoding request scheduled with k draft slots runs, in one step:

    propose d1..dk        n-gram lookup in its own tokens, or k passes of a small draft model
    target forward        over [t, d1, ..., dk] (t: its last token), extend attention over
                          the paged KV, logits at all k + 1 positions
    verify                greedy: accept the longest prefix of drafts equal to the target's
                          argmax, then the target's token at the first mismatch (or the
                          bonus token after all k);
                          sampled: accept d_j with probability min(1, p_j(d_j) / q_j(d_j));
                          on the first rejection draw from norm(max(0, p_j - q_j)) and stop;
                          after all k, draw the bonus token from p_k

so a step yields between 1 and k + 1 tokens, distributed exactly as the target's own
sampling would have produced them (Leviathan et al., 2023; Chen et al., 2023). `p` is the
target's distribution after temperature / top-k / top-p, `q` the drafter's (a point mass at
the proposal for the n-gram drafter, which needs no model). The KV written for rejected
drafts lies past the request's computed tokens; the runner and the scheduler both cut the
block table back to the blocks the computed tokens use.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np
import torch

from common.messages.types import SamplingParams
from gpu_worker.sample.sampling import greedy, probabilities


# --- n-gram (prompt lookup) drafting -----------------------------------------------------------
def ngram_propose(token_ids: Sequence[int], k: int, min_n: int, max_n: int) -> list[int]:
    """Up to k tokens that followed the latest earlier occurrence of the context's longest
    suffix n-gram (max_n down to min_n tokens); [] when no suffix occurred before."""
    total = len(token_ids)
    if k < 1 or total < min_n + 1:
        return []
    tokens = np.asarray(token_ids, dtype=np.int64)
    for n in range(min(max_n, total - 1), min_n - 1, -1):
        suffix = tokens[total - n :]
        # windows starting at 0 .. total - n - 1: every earlier place the suffix may occur
        windows = np.lib.stride_tricks.sliding_window_view(tokens[: total - 1], n)
        hits = np.flatnonzero((windows == suffix).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n
            return tokens[start : start + k].tolist()
    return []


# --- verification ------------------------------------------------------------------------------
@dataclasses.dataclass
class Verdict:
    tokens: list[int]  # accepted drafts, then the target's token: 1 .. len(drafts) + 1
    num_accepted: int  # drafts accepted


def verify(
    logits: torch.Tensor,  # [m + 1, vocab] float32: target logits at t, d1, ..., dm
    drafts: list[int],  # [m]
    params: SamplingParams,
    generator: torch.Generator | None,
    draft_probs: torch.Tensor | None = None,  # [m, vocab] q of a sampling draft model
) -> Verdict:
    """The tokens one request keeps from a verified step (see the module's docstring)."""
    m = len(drafts)
    assert logits.shape[0] == m + 1, "one row of logits per draft, plus one"
    if params.is_greedy:
        target = greedy(logits).tolist()
        a = 0
        while a < m and drafts[a] == target[a]:
            a += 1
        return Verdict(drafts[:a] + [target[a]], a)
    assert generator is not None, "a sampled request needs a generator"
    p = probabilities(logits, [params] * (m + 1))  # [m + 1, vocab]
    draws = torch.rand(m, generator=generator, device=p.device).tolist() if m else []
    for j, d in enumerate(drafts):
        q_d = 1.0 if draft_probs is None else float(draft_probs[j, d])
        p_d = float(p[j, d])
        if q_d > 0 and draws[j] < min(1.0, p_d / q_d):
            continue  # accepted
        # rejected: the residual max(0, p - q), renormalised
        if draft_probs is None:
            residual = p[j].clone()
            residual[d] = 0.0
        else:
            residual = (p[j] - draft_probs[j]).clamp_(min=0.0)
        if float(residual.sum()) <= 0.0:  # p == q (up to rounding): any draw from p will do
            residual = p[j]
        token = int(torch.multinomial(residual, 1, generator=generator)[0])
        return Verdict(list(drafts[:j]) + [token], j)
    bonus = int(torch.multinomial(p[m], 1, generator=generator)[0])
    return Verdict(list(drafts) + [bonus], m)


# --- a draft model ------------------------------------------------------------------------------
class DraftModel:
    """A small model with the target's tokenizer, and its own KV pool.

    The pool has the target pool's block count and block size and is indexed by the same
    block tables, so it needs no allocator of its own: each request's draft KV lives in the
    request's own blocks. What the draft pool holds for a request is tracked per request
    (`draft_computed`): it is caught up from the request's tokens at the start of each
    proposal (the whole prompt, the first time), and reset whenever the target's KV moves
    (preemption, swap, a fork's copy), since those copy only the target pool. A prefix-cache
    hit shares target blocks whose draft KV may never have been written, so a request always
    starts with draft_computed 0; rewriting a shared block's draft KV writes the same values,
    as the tokens and positions are the same.
    """

    def __init__(
        self,
        path: str,
        *,
        block_size: int,
        num_blocks: int,
        dtype: torch.dtype,
        device: torch.device,
        max_positions: int,
        attention_backend: str,
        target_vocab_size: int,
    ) -> None:
        from gpu_worker.attention import create_backend
        from gpu_worker.kv_cache import KVCache
        from gpu_worker.model_loader.hf_folder import read_hf_config
        from gpu_worker.model_loader.loader import load_model
        from gpu_worker.models.llama_config import LlamaConfig

        self.path = path
        self.config = LlamaConfig.from_hf(read_hf_config(path))
        if self.config.vocab_size > target_vocab_size:
            raise ValueError(
                f"draft model {path} has {self.config.vocab_size} tokens, the "
                f"target {target_vocab_size}: it needs the target's tokenizer"
            )
        self.backend = create_backend(
            attention_backend,
            num_heads=self.config.num_heads,
            num_kv_heads=self.config.num_kv_heads,
            head_dim=self.config.head_dim,
            dtype=dtype,
            device=device,
            **self.config.attention_options(),
        )
        self.model = load_model(
            path, self.backend, dtype=dtype, device=device, max_positions=max_positions
        )
        self.kv_cache = KVCache(
            num_layers=self.config.num_layers,
            num_blocks=num_blocks,
            block_size=block_size,
            num_kv_heads=self.config.num_kv_heads,
            head_dim=self.config.head_dim,
            dtype=dtype,
            device=device,
        )
        self.block_size = block_size
        self.device = device
        self.target_vocab_size = target_vocab_size

    @torch.inference_mode()
    def propose(
        self,
        token_ids: list[list[int]],  # [R] each request's known tokens
        draft_computed: list[int],  # [R] tokens already in the draft pool
        block_tables: list[list[int]],  # [R] covering len(tokens) + k - 1 positions
        ks: list[int],  # [R] drafts wanted
        params: list[SamplingParams],
        generators: list[torch.Generator | None],
    ) -> tuple[list[list[int]], list[torch.Tensor | None], list[int]]:
        """Drafts for each request, their q rows (None for greedy requests), and how many
        tokens the draft pool then holds per request (before verification)."""
        num = len(token_ids)
        drafts: list[list[int]] = [[] for _ in range(num)]
        q_rows: list[list[torch.Tensor]] = [[] for _ in range(num)]
        computed = list(draft_computed)
        # pass 1 catches each request up to its last token; passes 2..k feed one draft each
        inputs = [tokens[c:] for tokens, c in zip(token_ids, computed, strict=True)]
        for step in range(max(ks, default=0)):
            active = [r for r in range(num) if step < ks[r]]
            if not active:
                break
            if step:
                inputs = [[] for _ in range(num)]
                for r in active:
                    inputs[r] = [drafts[r][-1]]
            logits = self._forward(
                [inputs[r] for r in active],
                [computed[r] for r in active],
                [block_tables[r] for r in active],
            )
            for row, r in enumerate(active):
                computed[r] += len(inputs[r])
                token, q = _draw(logits[row], params[r], generators[r], self.target_vocab_size)
                drafts[r].append(token)
                if q is not None:
                    q_rows[r].append(q)
        probs = [torch.stack(rows) if rows else None for rows in q_rows]
        return drafts, probs, computed

    def _forward(
        self, inputs: list[list[int]], computed: list[int], tables: list[list[int]]
    ) -> torch.Tensor:
        """Logits at each request's last input token; single-token inputs first."""
        from gpu_worker.attention import build_metadata

        order = sorted(range(len(inputs)), key=lambda r: len(inputs[r]) != 1)
        flat: list[int] = []
        last: dict[int, int] = {}
        for r in order:
            flat.extend(inputs[r])
            last[r] = len(flat) - 1
        meta = build_metadata(
            [computed[r] for r in order],
            [len(inputs[r]) for r in order],
            [tables[r] for r in order],
            self.block_size,
            self.device,
        )
        meta = self.backend.build_metadata(meta)
        ids = torch.tensor(flat, dtype=torch.int64).to(self.device)
        index = torch.tensor(
            [last[r] for r in range(len(inputs))], dtype=torch.int64, device=self.device
        )
        return self.model(ids, meta.positions, self.kv_cache.tensor, meta, index).float()


def _draw(
    logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None, vocab_size: int
) -> tuple[int, torch.Tensor | None]:
    """The draft's next token: its argmax, or a draw from q (returned, padded to the
    target's vocabulary, where the target may have more, unused, rows)."""
    if params.is_greedy:
        return int(logits.argmax()), None
    q = probabilities(logits[None], [params])[0]
    token = int(torch.multinomial(q, 1, generator=generator)[0])
    if q.shape[0] < vocab_size:
        q = torch.nn.functional.pad(q, (0, vocab_size - q.shape[0]))
    return token, q
