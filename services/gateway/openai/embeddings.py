"""POST /v1/embeddings (OpenAI's, with vLLM's extensions): the body, its engine requests,
and the answer.

    {"model"?, "input": str | [str] | [int] | [[int]], "encoding_format"?: float | base64,
     "dimensions"?, "user"? (ignored), vLLM's "truncate_prompt_tokens"?,
     "add_special_tokens"? (default true), "normalize"? (default --embedding-normalize)}
    -> {"id", "object": "list", "created", "model",
        "data": [{"object": "embedding", "index", "embedding"}, ...] (in input order),
        "usage": {"prompt_tokens", "total_tokens"}}

Each input is one engine request whose sampling asks for pooling (the server's --pooling):
the engine computes its prompt and answers the pooled final-normed hidden states instead of
a token. Here the vector is cut to `dimensions` (the tokenizer has checked that the model
allows it: Matryoshka) and then L2-normalised, vLLM's order, and written as floats or as
base64 of its little-endian float32 bytes.
"""

from __future__ import annotations

import array
import base64
import math
import struct
import time
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from common.limits import INT32_MAX, MAX_EMBEDDING_INPUTS
from common.messages import GenerateRequest, SamplingParams
from services.gateway.openai.completions_protocol import prompt_batch
from services.gateway.openai.refused import IGNORED_FIELDS, REFUSED_EMBEDDING, refuse_unsupported
from services.gateway.openai.request_errors import RequestRejected
from services.gateway.openai.unknown_fields import check_unknown

Input = str | list[int]
PositiveInt = Annotated[int, Field(ge=1, le=INT32_MAX)]
_STRICT = ConfigDict(strict=True, extra="ignore")  # as the generate bodies are parsed
_NORM_EPS = 1e-12  # torch.nn.functional.normalize's, as vLLM's pooler normalises


def _inputs(value: Any) -> list[Input]:
    """`input` as a list of inputs, each a string or a list of token ids."""
    return prompt_batch(value, "input", MAX_EMBEDDING_INPUTS)


class EmbeddingRequest(BaseModel):
    """Body of POST /v1/embeddings."""

    model_config = _STRICT
    model: str | None = None
    input: Any  # list[Input] once validated: one engine request each
    encoding_format: Literal["float", "base64"] | None = None
    dimensions: PositiveInt | None = None  # Matryoshka: the vector's first `dimensions`
    truncate_prompt_tokens: PositiveInt | None = None  # vLLM's: keep each input's last k
    add_special_tokens: bool | None = None  # vLLM's: the tokenizer's special tokens (BOS)
    normalize: bool | None = None  # vLLM's: L2-normalise (None: the server's setting)

    _check_input = field_validator("input", mode="before")(_inputs)

    @model_validator(mode="before")
    @classmethod
    def _refuse_unsupported(cls, data: Any, info: ValidationInfo) -> Any:
        known = [*REFUSED_EMBEDDING, *IGNORED_FIELDS]
        check_unknown(data, cls, known, cls.__name__, info.context)
        return refuse_unsupported(data, REFUSED_EMBEDDING, cls.__name__)

    def to_generate_requests(
        self, request_id: str, model: str, pooling: str, max_model_len: int
    ) -> list[GenerateRequest]:
        """One engine request per input: `request_id` for a single one, else
        `<request_id>-<k>` for input k."""
        truncate = self.truncate_prompt_tokens
        if truncate is not None and truncate > max_model_len:
            raise RequestRejected(
                f"truncate_prompt_tokens: must be <= the model's maximum context length "
                f"({max_model_len}), got {truncate}",
                "truncate_prompt_tokens",
            )
        # greedy: the engine makes no sampling generator for a request that samples nothing
        sampling = SamplingParams(max_tokens=1, temperature=0.0, pooling=pooling)
        inputs: list[Input] = self.input
        arrival = time.time()
        return [
            GenerateRequest(
                request_id=request_id if len(inputs) == 1 else f"{request_id}-{k}",
                model=model,
                sampling=sampling,
                prompt=value if isinstance(value, str) else None,
                prompt_token_ids=None if isinstance(value, str) else list(value),
                arrival_time=arrival,
                add_special_tokens=self.add_special_tokens is not False,
                truncate_prompt_tokens=truncate,
                dimensions=self.dimensions,
            )
            for k, value in enumerate(inputs)
        ]


def shape_vector(vector: list[float], dimensions: int | None, normalize: bool) -> list[float]:
    """The answer's vector: the first `dimensions` of the pooled one, then L2-normalised,
    as float32 values (what base64 carries, so both encodings hold the same numbers)."""
    if dimensions is not None:
        vector = vector[:dimensions]
    if normalize:
        norm = max(math.sqrt(math.fsum(x * x for x in vector)), _NORM_EPS)
        vector = [x / norm for x in vector]
    return array.array("f", vector).tolist()


def encode_vector(vector: list[float], encoding_format: str | None) -> list[float] | str:
    """`float`: the numbers; `base64`: their little-endian float32 bytes, base64-encoded."""
    if encoding_format == "base64":
        return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode("ascii")
    return vector


def embedding_body(
    response_id: str, model: str, vectors: list[list[float] | str], num_prompt_tokens: int
) -> dict[str, Any]:
    """The answer to POST /v1/embeddings, vectors in input order."""
    return {
        "id": response_id,
        "object": "list",
        "created": int(time.time()),
        "model": model,
        "data": [
            {"object": "embedding", "index": i, "embedding": vector}
            for i, vector in enumerate(vectors)
        ],
        "usage": {"prompt_tokens": num_prompt_tokens, "total_tokens": num_prompt_tokens},
    }
