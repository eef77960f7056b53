"""Which `dimensions` an embeddings request may ask of the served model (vLLM's rule, pure
logic): a model trained with Matryoshka representation learning says so in its config.json,
`is_matryoshka: true` (any size up to its hidden size) or `matryoshka_dimensions: [...]`
(those sizes only); any other model refuses `dimensions`, since a cut vector of a model not
trained for it is a poor embedding."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import orjson

from services.tokenizer.validate import InvalidRequest


@dataclasses.dataclass(frozen=True)
class Matryoshka:
    """The served model's Matryoshka facts, read from its config.json."""

    hidden_size: int = 0  # the pooled vector's size (0: unknown)
    supported: bool = False
    allowed: tuple[int, ...] = ()  # the sizes it was trained for (empty: any)


def read_matryoshka(model_dir: Path) -> Matryoshka:
    """The facts of the model in `model_dir` (none for a folder without config.json)."""
    path = model_dir / "config.json"
    if not path.is_file():
        return Matryoshka()
    config = orjson.loads(path.read_bytes())
    allowed = tuple(int(d) for d in config.get("matryoshka_dimensions") or ())
    supported = bool(config.get("is_matryoshka")) or bool(allowed)
    return Matryoshka(int(config.get("hidden_size") or 0), supported, allowed)


def check_dimensions(dimensions: int | None, facts: Matryoshka, model: str) -> None:
    """Refuse `dimensions` the model does not allow, naming the field."""
    if dimensions is None or dimensions == facts.hidden_size:
        return  # (the whole vector: nothing is cut)
    if not facts.supported:
        raise InvalidRequest(
            "dimensions",
            f'model "{model}" does not support matryoshka representation, changing output '
            "dimensions will lead to poor results",
        )
    if facts.allowed and dimensions not in facts.allowed:
        raise InvalidRequest(
            "dimensions", f"model {model!r} supports only {list(facts.allowed)}, got {dimensions}"
        )
    if facts.hidden_size and dimensions > facts.hidden_size:
        raise InvalidRequest(
            "dimensions", f"must be <= the model's hidden size ({facts.hidden_size})"
        )
