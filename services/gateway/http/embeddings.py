"""POST /v1/embeddings over an `EngineClient` (the body: services/gateway/openai/embeddings.py).

Each input is one engine request (pooling: the server's --pooling), all of them in flight at
once; the answer lists their vectors in input order once every one is done. A refusal of any
input (too long, bad `dimensions`) is the answer's 400, naming `input` where the engine named
the prompt. As for every route, the engine requests end when the HTTP exchange does: a client
that disconnects aborts the ones still running.
"""

from __future__ import annotations

from typing import Any

import orjson
from fastapi import APIRouter, Request
from starlette.responses import Response

from services.gateway.engine.client import EngineClient
from services.gateway.engine.embed import embed
from services.gateway.http.deltas import until_disconnected
from services.gateway.http.errors import REQUEST_ID_HEADER, take_request_id
from services.gateway.http.openapi import json_body
from services.gateway.openai.embeddings import (
    EmbeddingRequest,
    embedding_body,
    encode_vector,
    shape_vector,
)
from services.gateway.openai.protocol import check_model
from services.gateway.openai.request_errors import parse_request

ID_PREFIX = "embd-"  # vLLM's


def embeddings_router(
    engine: EngineClient, context: dict[str, Any] | None, pooling: str, normalize: bool
) -> APIRouter:
    """POST /v1/embeddings over `engine` (the caller adds the API key check): vectors pooled
    by `pooling` (last | mean), L2-normalised unless `normalize` is off (a request's own
    `normalize` wins)."""
    router = APIRouter()

    async def embeddings(request: Request) -> Response:
        request_id = take_request_id(request, ID_PREFIX)
        body = parse_request(EmbeddingRequest, await request.body(), context)
        check_model(body.model, engine.model_names, engine.is_ready(), engine.draining)
        requests = body.to_generate_requests(
            request_id, engine.model_name, pooling, engine.max_model_len
        )
        done = await until_disconnected(request, embed(engine, requests, "input"))
        wants_norm = normalize if body.normalize is None else body.normalize
        vectors = [
            encode_vector(
                shape_vector(d.embedding, body.dimensions, wants_norm), body.encoding_format
            )
            for d in done
        ]
        num_prompt_tokens = sum(d.num_prompt_tokens for d in done)
        response_id = request_id if request_id.startswith(ID_PREFIX) else ID_PREFIX + request_id
        answer = embedding_body(response_id, engine.model_name, vectors, num_prompt_tokens)
        headers = {REQUEST_ID_HEADER: request_id}
        return Response(orjson.dumps(answer), headers=headers, media_type="application/json")

    router.add_api_route(
        "/v1/embeddings", embeddings, methods=["POST"], openapi_extra=json_body(EmbeddingRequest)
    )
    return router
