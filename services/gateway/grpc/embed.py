"""shuttle.v1 Embed to and from the engine's types, by the HTTP API's rules: the proto is
turned into the body POST /v1/embeddings would have received and validated by the same
model (services/gateway/openai/embeddings.py); refusals name the proto's fields (`input` ->
`inputs`, `X-Request-Id` -> `request_id`)."""

from __future__ import annotations

import uuid
from typing import Any

from common.messages import GenerateRequest
from proto import shuttle_pb2 as pb
from services.gateway.engine.client import EngineClient, OutputDelta
from services.gateway.grpc.convert import check_request_id, refuse_unknown_fields
from services.gateway.openai.embeddings import EmbeddingRequest, shape_vector
from services.gateway.openai.protocol import check_model
from services.gateway.openai.request_errors import validate_request

REQUEST_ID_PREFIX = "embd-"
RENAMES = {"input": "inputs", "X-Request-Id": "request_id"}
_OPTIONAL_FIELDS = ("dimensions", "normalize", "truncate_prompt_tokens", "add_special_tokens")


def embed_request_id(request: pb.EmbedRequest) -> str:
    """The client's id if valid (RequestRejected if not), else a fresh one."""
    if not request.request_id:
        return REQUEST_ID_PREFIX + uuid.uuid4().hex
    check_request_id(request.request_id)
    return request.request_id


def to_embedding_request(
    request: pb.EmbedRequest, engine: EngineClient, context: dict[str, Any] | None = None
) -> EmbeddingRequest:
    """Validate as POST /v1/embeddings would; RequestRejected with the HTTP API's message."""
    refuse_unknown_fields(request)
    data: dict[str, Any] = {f: getattr(request, f) for f in _OPTIONAL_FIELDS if request.HasField(f)}
    if request.model:
        data["model"] = request.model
    data["input"] = [_input(i) for i in request.inputs]
    body = validate_request(EmbeddingRequest, data, context=context)
    check_model(body.model, engine.model_names, engine.is_ready(), engine.draining)
    return body


def _input(item: pb.EmbedInput) -> str | list[int] | None:
    kind = item.WhichOneof("input")
    if kind == "token_ids":
        return list(item.token_ids.ids)
    return item.text if kind == "text" else None  # (None: refused as the wrong type)


def to_engine_requests(
    body: EmbeddingRequest, request_id: str, engine: EngineClient, pooling: str
) -> list[GenerateRequest]:
    return body.to_generate_requests(request_id, engine.model_name, pooling, engine.max_model_len)


def to_embed_response(
    request_id: str,
    model: str,
    body: EmbeddingRequest,
    done: list[OutputDelta],
    normalize: bool,
) -> pb.EmbedResponse:
    """The answer: each input's vector shaped as HTTP's (dimensions, then normalised)."""
    norm = normalize if body.normalize is None else body.normalize
    embeddings = [
        pb.Embedding(values=shape_vector(d.embedding, body.dimensions, norm)) for d in done
    ]
    num_prompt = sum(d.num_prompt_tokens for d in done)
    usage = pb.Usage(prompt_tokens=num_prompt, total_tokens=num_prompt)
    return pb.EmbedResponse(request_id=request_id, model=model, embeddings=embeddings, usage=usage)
