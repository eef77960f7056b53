"""A tokenizer process: chat template, tokenisation, validation. Holds no request state.

The served model can change at run time (a hot-swap, a worker restart); the scheduler owns
that fact and pushes `ModelChanged`. From then on requests are tokenised with the new
model's tokenizer and checked against its facts, and every `TokenizedRequest` names the
fingerprint of the tokenizer that made its ids, so the scheduler never starts it on a model
whose vocabulary differs.

Chat messages are rendered by the request's own template, else the operator's
(--chat-template, read once here at start-up and kept across model changes), else the served
model's; with the request's chat_template_kwargs as extra template variables.
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

import orjson

from common.actor import Actor
from common.config import Config
from common.messages import (
    DetokenizeQuery,
    GenerateRequest,
    ModelChanged,
    RequestError,
    SamplingParams,
    TokenizedRequest,
    TokenizeQuery,
    TokenizeResult,
)
from common.model_facts import load_model_facts, tokenizer_fingerprint
from common.model_paths import tokenizer_dir
from common.topology import engine_entry_addr
from services.tokenizer.chat_template import load_chat_template, template_kwargs
from services.tokenizer.matryoshka import Matryoshka, check_dimensions, read_matryoshka
from services.tokenizer.sampling import bad_words_token_ids, fill_defaults, read_sampling_defaults
from services.tokenizer.tool_prompt import (
    builtin_messages,
    check_tools_rendered,
    renders_tools,
    template_messages,
    tool_specs,
)
from services.tokenizer.validate import (
    InvalidRequest,
    check_control_token_ids,
    check_embedding_prompt,
    check_min_tokens,
    check_prompt_chars,
    check_sampling,
    check_token_ids,
    fit_max_tokens,
)

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True, slots=True)
class ServedModel:
    """What tokenising and validating a request needs to know about the served model."""

    tokenizer: PreTrainedTokenizerBase
    fingerprint: str  # tokenizer_fingerprint of the folder the tokenizer came from
    max_model_len: int
    vocab_size: int  # prompt token ids must be below it
    eos_token_ids: list[int]
    sampling_defaults: dict[str, float]  # from generation_config.json (--generation-config)
    # the `dimensions` embeddings requests may ask for (config.json)
    matryoshka: Matryoshka = dataclasses.field(default_factory=Matryoshka)


def load_tokenizer(model_dir: Path) -> PreTrainedTokenizerBase:
    from transformers import AutoTokenizer

    # a GGUF file's tokenizer: the folder written from its metadata
    tokenizer: PreTrainedTokenizerBase = AutoTokenizer.from_pretrained(tokenizer_dir(model_dir))
    return tokenizer


# how near its end a prompt may hold the end of reasoning for the answer to start there
REASONING_END_WINDOW = 8


def reasoning_ended(prompt_ids: list[int], end_ids: list[int]) -> bool:
    """Whether the prompt itself closed the reasoning (a template with thinking switched off
    writes an empty <think></think> at its end): then a grammar starts at the first token,
    as vLLM's structured outputs check the prompt for the reasoning end."""
    if not end_ids:
        return False
    tail = prompt_ids[-(REASONING_END_WINDOW + len(end_ids)) :]
    n = len(end_ids)
    return any(tail[i : i + n] == end_ids for i in range(len(tail) - n + 1))


def _with_tokenizer_eos(eos_token_ids: list[int], tokenizer: PreTrainedTokenizerBase) -> list[int]:
    eos = tokenizer.eos_token_id
    return sorted({*eos_token_ids, eos}) if isinstance(eos, int) else sorted(eos_token_ids)


def startup_model(
    model_dir: Path, max_model_len_override: int = 0, generation_config: str = "auto"
) -> ServedModel:
    """The model named on the command line, read from its folder (before any ModelChanged)."""
    tokenizer = load_tokenizer(model_dir)
    facts = load_model_facts(model_dir, max_model_len_override)
    return ServedModel(
        tokenizer=tokenizer,
        fingerprint=tokenizer_fingerprint(model_dir),
        max_model_len=facts["max_model_len"],
        vocab_size=max(facts["vocab_size"], len(tokenizer)),
        eos_token_ids=_with_tokenizer_eos(facts["eos_token_ids"], tokenizer),
        sampling_defaults=read_sampling_defaults(model_dir, generation_config),
        matryoshka=read_matryoshka(model_dir),
    )


class TokenizerActor(Actor):
    name = "tokenizer"

    def __init__(self, config: Config, index: int) -> None:
        super().__init__(config, inbox_addr=config.tokenizer_addrs()[index])
        self.index = index
        # the operator's template: the server's, not a model's, so a ModelChanged keeps it
        self.chat_template = load_chat_template(config.server.chat_template)
        self.handlers[GenerateRequest] = self._on_generate
        self.handlers[ModelChanged] = self._on_model_changed
        self.handlers[TokenizeQuery] = self._on_tokenize_query
        self.handlers[DetokenizeQuery] = self._on_detokenize_query

    @property
    def inbox_name(self) -> str:
        return f"tokenizer-{self.index}"

    async def start(self) -> None:
        m = self.config.model
        self.model = startup_model(Path(m.model), m.max_model_len, m.generation_config)
        self.scheduler = self.outbox(engine_entry_addr(self.config))  # scheduler, or router
        self.gateway = self.gateways()

    def ready_info(self) -> dict[str, Any]:
        m = self.model
        return {
            "eos_token_ids": m.eos_token_ids,
            "max_model_len": m.max_model_len,
            "vocab_size": m.vocab_size,
            "tokenizer_fingerprint": m.fingerprint,
        }

    def _on_model_changed(self, msg: ModelChanged) -> None:
        """Tokenise with the new model's tokenizer from now on. Loading one takes a while;
        requests queue in the inbox meanwhile. If it fails the old one goes on serving (the
        scheduler then has requests tokenised again until the gateway gives up on them)."""
        tokenizer = self.model.tokenizer
        if msg.tokenizer_fingerprint != self.model.fingerprint:
            try:
                tokenizer = load_tokenizer(Path(msg.path))
            except Exception:
                log.exception(
                    "cannot load the tokenizer of %s (%s); keeping %s",
                    msg.path,
                    msg.tokenizer_fingerprint,
                    self.model.fingerprint,
                )
                return
            log.info(
                "tokenizer %s -> %s (%s)",
                self.model.fingerprint,
                msg.tokenizer_fingerprint,
                msg.path,
            )
        self.model = ServedModel(
            tokenizer=tokenizer,
            fingerprint=msg.tokenizer_fingerprint,
            max_model_len=msg.max_model_len,
            vocab_size=msg.vocab_size,
            eos_token_ids=_with_tokenizer_eos(msg.eos_token_ids, tokenizer),
            sampling_defaults=read_sampling_defaults(
                Path(msg.path), self.config.model.generation_config
            ),
            matryoshka=read_matryoshka(Path(msg.path)),
        )

    def _on_generate(self, req: GenerateRequest) -> None:
        try:
            self.scheduler.send(self.tokenize(req))
        except InvalidRequest as e:
            self.gateway.send(
                RequestError(
                    request_id=req.request_id, status=e.status, message=e.message, param=e.param
                )
            )

    def tokenize(self, req: GenerateRequest) -> TokenizedRequest:
        model = self.model
        sampling = self._sampling(req, model)
        ids = self._prompt_ids(req, model)
        if req.truncate_prompt_tokens is not None:  # vLLM's: the prompt's last k tokens
            ids = ids[-req.truncate_prompt_tokens :]
        if reasoning_ended(ids, sampling.structured_after_ids):
            sampling = dataclasses.replace(sampling, structured_after="", structured_after_ids=[])
        if sampling.pooling:  # embeddings: the prompt only, up to the model's length
            check_embedding_prompt(len(ids), model.max_model_len)
            check_dimensions(req.dimensions, model.matryoshka, req.model)
            max_tokens = sampling.max_tokens
        else:
            max_tokens = fit_max_tokens(len(ids), sampling.max_tokens, model.max_model_len)
        check_min_tokens(sampling.min_tokens, max_tokens)
        return TokenizedRequest(
            request_id=req.request_id,
            prompt_token_ids=ids,
            sampling=dataclasses.replace(sampling, max_tokens=max_tokens),
            eos_token_ids=model.eos_token_ids,
            arrival_time=req.arrival_time,
            priority=req.priority,
            timeout=req.timeout,
            tokenizer_fingerprint=model.fingerprint,
            cache_salt=req.cache_salt,
            lora_name=req.lora_name,
            resumed_token_ids=req.resumed_token_ids,
        )

    def _sampling(self, req: GenerateRequest, model: ServedModel) -> SamplingParams:
        """The request's sampling with the model's defaults filled in and its bad words
        tokenised, checked."""
        sampling = fill_defaults(req.sampling, req.unset_sampling, model.sampling_defaults)
        check_sampling(sampling)
        if sampling.bad_words:

            def encode(text: str) -> list[int]:
                return list(model.tokenizer.encode(text, add_special_tokens=False))

            words = bad_words_token_ids(sampling.bad_words, encode)
            sampling = dataclasses.replace(sampling, bad_words_token_ids=words)
        if sampling.structured_after:  # the end of reasoning, where the grammar starts
            after = list(
                model.tokenizer.encode(sampling.structured_after, add_special_tokens=False)
            )
            sampling = dataclasses.replace(sampling, structured_after_ids=after)
        check_control_token_ids(sampling, model.vocab_size)
        return sampling

    def _prompt_ids(self, req: GenerateRequest, model: ServedModel) -> list[int]:
        if req.prompt_token_ids is not None:
            check_token_ids(req.prompt_token_ids, model.vocab_size)
            return list(req.prompt_token_ids)
        if req.messages is not None:
            return self._chat_ids(
                req.messages,
                req.add_generation_prompt,
                bool(req.add_special_tokens),  # (the template writes its own by default)
                model,
                req.chat_template,
                req.chat_template_kwargs,
                req.tools,
                req.continue_final_message,
            )
        special = req.add_special_tokens is not False  # (a completions prompt: yes by default)
        return self._text_ids(req.prompt, special, model)

    def _chat_ids(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool,
        add_special_tokens: bool,
        model: ServedModel,
        chat_template: str | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        tools: list[dict[str, Any]] | None = None,
        continue_final_message: bool = False,
    ) -> list[int]:
        """Messages rendered by the chat template (the request's, the operator's or the
        model's; with `tools` as services/tokenizer/tool_prompt.py says), then tokenised (the
        template writes the special tokens it wants, so generation adds none unless asked).
        `continue_final_message`: the last message is left open for the model to go on."""
        if not messages:
            raise InvalidRequest("messages", "must hold at least one message")
        num_chars = sum(len(str(m.get("content") or "")) for m in messages)
        num_chars += len(orjson.dumps(tools)) if tools else 0
        check_prompt_chars("messages", num_chars, self.config.server.max_prompt_chars)
        extra = template_kwargs(chat_template_kwargs)
        template = chat_template or self.chat_template
        own_tools = renders_tools(
            template if template is not None else model.tokenizer.chat_template
        )

        def render(tools: list[dict[str, Any]] | None) -> str:
            if own_tools:
                kwargs = extra if tools is None else {**extra, "tools": tool_specs(tools)}
                chat = template_messages(messages)
            else:
                kwargs, chat = extra, builtin_messages(messages, tools)
            return str(
                model.tokenizer.apply_chat_template(
                    chat,
                    chat_template=template,
                    tokenize=False,
                    add_generation_prompt=add_generation_prompt,
                    continue_final_message=continue_final_message,
                    **kwargs,
                )
            )

        try:
            text = render(tools)
            bare = render([]) if tools else ""  # what the tools add, apart from history
        except Exception as e:  # a template may raise on roles it does not allow
            if chat_template:  # the request's own template: the fault may be its
                raise InvalidRequest("chat_template", f"cannot render the messages: {e}") from e
            field = "tools" if tools else "messages"
            raise InvalidRequest(field, f"the chat template rejected them: {e}") from e
        if tools:
            check_tools_rendered(text, bare, tools)
        return list(model.tokenizer.encode(text, add_special_tokens=add_special_tokens))

    def _text_ids(
        self, prompt: str | None, add_special_tokens: bool, model: ServedModel
    ) -> list[int]:
        if not prompt:
            raise InvalidRequest("prompt", "must not be empty")
        check_prompt_chars("prompt", len(prompt), self.config.server.max_prompt_chars)
        return list(model.tokenizer.encode(prompt, add_special_tokens=add_special_tokens))

    # /tokenize and /detokenize: answered to the gateway, nothing is generated -------------

    def _on_tokenize_query(self, q: TokenizeQuery) -> None:
        model = self.model
        try:
            if q.messages is not None:
                ids = self._chat_ids(
                    q.messages,
                    q.add_generation_prompt,
                    q.add_special_tokens,
                    model,
                    q.chat_template,
                    q.chat_template_kwargs,
                    q.tools,
                )
            else:
                ids = self._text_ids(q.prompt, q.add_special_tokens, model)
            result = TokenizeResult(query_id=q.query_id, token_ids=ids)
        except InvalidRequest as e:
            result = _refusal(q.query_id, e)
        self.outbox(q.reply_to).send(result)

    def _on_detokenize_query(self, q: DetokenizeQuery) -> None:
        model = self.model
        try:
            check_token_ids(q.token_ids, model.vocab_size, "tokens")
            text = str(model.tokenizer.decode(q.token_ids))
            result = TokenizeResult(query_id=q.query_id, text=text)
        except InvalidRequest as e:
            result = _refusal(q.query_id, e)
        self.outbox(q.reply_to).send(result)


def _refusal(query_id: int, e: InvalidRequest) -> TokenizeResult:
    return TokenizeResult(query_id=query_id, status=e.status, message=e.message, param=e.param)
