"""tools/bench workloads: random token ids (optionally behind a shared prefix), or a JSONL file.

A JSONL line is one request: `{"prompt": "text"}` or `{"prompt_token_ids": [1, 2, ...]}`,
with an optional `"output_len": N` (else the --output-len range is drawn from). Text prompts
are sent as text, so any server tokenises them its own way; the baselines tokenise them with
the model folder's tokenizer.
"""

from __future__ import annotations

import dataclasses
import json
import random
from pathlib import Path

Prompt = list[int] | str


@dataclasses.dataclass
class Workload:
    """The requests of one run: a prompt (token ids or text) and an output length each."""

    prompts: list[Prompt]
    output_lens: list[int]

    @property
    def num_prompt_tokens(self) -> int:
        """Token-id prompts only; a text prompt's count comes from the server's usage."""
        return sum(len(p) for p in self.prompts if not isinstance(p, str))

    @property
    def num_output_tokens(self) -> int:
        return sum(self.output_lens)

    def describe(self) -> dict[str, int]:
        lens = [len(p) for p in self.prompts if not isinstance(p, str)]
        return {
            "num_requests": len(self.prompts),
            "prompt_tokens": sum(lens),
            "min_prompt": min(lens, default=0),
            "max_prompt": max(lens, default=0),
            "num_text_prompts": sum(isinstance(p, str) for p in self.prompts),
            "output_tokens": self.num_output_tokens,
            "min_output": min(self.output_lens, default=0),
            "max_output": max(self.output_lens, default=0),
        }


def parse_range(text: str) -> tuple[int, int]:
    """ "N" or "LO:HI" (inclusive)."""
    lo, _, hi = text.partition(":")
    low, high = int(lo), int(hi or lo)
    if not 0 < low <= high:
        raise ValueError(f"bad length range {text!r}: want N or LO:HI with 0 < LO <= HI")
    return low, high


def make_workload(
    n: int, input_len: str, output_len: str, vocab: int, seed: int, shared_prefix: int = 0
) -> Workload:
    """Random prompts; with `shared_prefix`, every prompt starts with the same tokens (a
    system prompt), followed by its own random part of `input_len` tokens."""
    rng = random.Random(seed)
    (ilo, ihi), (olo, ohi) = parse_range(input_len), parse_range(output_len)
    # ids from the middle of the vocabulary: ordinary word pieces, no special tokens
    word = lambda: rng.randrange(1000, vocab - 1000)  # noqa: E731
    prefix = [word() for _ in range(shared_prefix)]
    prompts: list[Prompt] = [
        prefix + [word() for _ in range(rng.randint(ilo, ihi))] for _ in range(n)
    ]
    return Workload(prompts, [rng.randint(olo, ohi) for _ in range(n)])


def load_jsonl(path: str | Path, output_len: str, seed: int, limit: int = 0) -> Workload:
    """Requests from a JSONL file (first `limit` lines when > 0); see the module docstring."""
    rng = random.Random(seed)
    olo, ohi = parse_range(output_len)
    prompts: list[Prompt] = []
    output_lens: list[int] = []
    for number, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        row = json.loads(line)
        if isinstance(row.get("prompt_token_ids"), list) and row["prompt_token_ids"]:
            prompts.append([int(t) for t in row["prompt_token_ids"]])
        elif isinstance(row.get("prompt"), str) and row["prompt"]:
            prompts.append(row["prompt"])
        else:
            raise ValueError(f"{path}:{number}: want a non-empty prompt or prompt_token_ids")
        out = row.get("output_len")
        output_lens.append(int(out) if out else rng.randint(olo, ohi))
        if limit and len(prompts) == limit:
            break
    if not prompts:
        raise ValueError(f"{path}: no requests")
    return Workload(prompts, output_lens)


def tokenized(prompts: list[Prompt], model_dir: str) -> list[list[int]]:
    """Every prompt as token ids (text through the folder's tokenizer), for the baselines."""
    if all(not isinstance(p, str) for p in prompts):
        return [list(p) for p in prompts if not isinstance(p, str)]
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(Path(model_dir) / "tokenizer.json"))
    return [
        tok.encode(p, add_special_tokens=False).ids if isinstance(p, str) else list(p)
        for p in prompts
    ]
