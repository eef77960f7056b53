"""A tokenizer process: chat template, tokenisation, validation. Holds no request state."""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import Any

from common.actor import Actor
from common.config import Config
from common.messages import GenerateRequest, RequestError, TokenizedRequest
from common.model_facts import load_model_facts, tokenizer_fingerprint
from services.tokenizer.validate import (
    InvalidRequest,
    check_prompt_chars,
    check_sampling,
    check_token_ids,
    fit_max_tokens,
)

log = logging.getLogger(__name__)


class TokenizerActor(Actor):
    name = "tokenizer"

    def __init__(self, config: Config, index: int) -> None:
        super().__init__(config, inbox_addr=config.tokenizer_addrs()[index])
        self.index = index
        self.handlers[GenerateRequest] = self._on_generate

    @property
    def inbox_name(self) -> str:
        return f"tokenizer-{self.index}"

    async def start(self) -> None:
        from transformers import AutoTokenizer

        model_dir = Path(self.config.model.model)
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.facts = load_model_facts(model_dir, self.config.model.max_model_len)
        if self.tokenizer.eos_token_id is not None:
            self.facts["eos_token_ids"] = sorted({*self.facts["eos_token_ids"],
                                                  self.tokenizer.eos_token_id})
        self.facts["vocab_size"] = max(self.facts["vocab_size"], len(self.tokenizer))
        self.fingerprint = tokenizer_fingerprint(model_dir)
        self.scheduler = self.outbox(self.config.addr("scheduler"))
        self.gateway = self.outbox(self.config.addr("gateway"))

    def ready_info(self) -> dict[str, Any]:
        return {**self.facts, "tokenizer_fingerprint": self.fingerprint}

    def _on_generate(self, req: GenerateRequest) -> None:
        try:
            self.scheduler.send(self.tokenize(req))
        except InvalidRequest as e:
            self.gateway.send(RequestError(request_id=req.request_id, status=e.status,
                                           message=e.message, param=e.param))

    def tokenize(self, req: GenerateRequest) -> TokenizedRequest:
        check_sampling(req.sampling)
        ids = self._prompt_ids(req)
        max_tokens = fit_max_tokens(len(ids), req.sampling.max_tokens,
                                    self.facts["max_model_len"])
        return TokenizedRequest(
            request_id=req.request_id,
            prompt_token_ids=ids,
            sampling=dataclasses.replace(req.sampling, max_tokens=max_tokens),
            eos_token_ids=self.facts["eos_token_ids"],
            arrival_time=req.arrival_time,
            priority=req.priority,
            timeout=req.timeout,
        )

    def _prompt_ids(self, req: GenerateRequest) -> list[int]:
        if req.prompt_token_ids is not None:
            check_token_ids(req.prompt_token_ids, self.facts["vocab_size"])
            return list(req.prompt_token_ids)
        if req.messages is not None:
            if not req.messages:
                raise InvalidRequest("messages", "must hold at least one message")
            num_chars = sum(len(str(m.get("content") or "")) for m in req.messages)
            check_prompt_chars("messages", num_chars, self.config.server.max_prompt_chars)
            try:
                text = self.tokenizer.apply_chat_template(
                    req.messages, tokenize=False,
                    add_generation_prompt=req.add_generation_prompt)
            except Exception as e:  # a template may raise on roles it does not allow
                raise InvalidRequest("messages", f"the chat template rejected them: {e}") from e
            return self.tokenizer.encode(text, add_special_tokens=False)
        if not req.prompt:
            raise InvalidRequest("prompt", "must not be empty")
        check_prompt_chars("prompt", len(req.prompt), self.config.server.max_prompt_chars)
        return self.tokenizer.encode(req.prompt, add_special_tokens=True)
