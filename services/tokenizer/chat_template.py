"""Which chat template renders a request, and with what variables. No transformers import.

Precedence, as vLLM's: the request's own `chat_template` > the operator's `--chat-template`
> the served model's (its tokenizer_config.json / chat_template.jinja). The operator's
template belongs to the server, not to a model: after a hot-swap it renders for whatever
model serves.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

from common.config import ConfigError
from services.tokenizer.validate import InvalidRequest

# what makes a string a template rather than a file name (vLLM's rule)
_JINJA_CHARS = "{}\n"

# apply_chat_template's own parameters: a chat_template_kwargs key among them would change
# how the call behaves (tokenize, return_dict, ...) instead of reaching the template
RESERVED_KWARGS = frozenset(
    {
        "conversation",
        "messages",
        "tools",
        "documents",
        "chat_template",
        "add_generation_prompt",
        "continue_final_message",
        "tokenize",
        "sanitize_control_tokens",
        "padding",
        "truncation",
        "max_length",
        "return_tensors",
        "return_dict",
        "return_assistant_tokens_mask",
        "tokenizer_kwargs",
    }
)


def load_chat_template(value: str) -> str | None:
    """--chat-template: a file's text, or the value itself when it is an inline template;
    None when unset. Raises ConfigError for a missing file or a template that does not parse,
    so a bad flag stops the server at start-up."""
    if not value:
        return None
    path = Path(value)
    try:
        is_file = path.is_file()
    except OSError:  # an inline template longer than a file name may be
        is_file = False
    if is_file:
        text = path.read_text()
    elif any(c in value for c in _JINJA_CHARS):
        text = value
    else:
        raise ConfigError(f"--chat-template {value!r}: no such file, and not a Jinja template")
    try:
        ImmutableSandboxedEnvironment().parse(text)
    except jinja2.TemplateSyntaxError as e:
        raise ConfigError(f"--chat-template: not a valid Jinja template: {e}") from None
    return text


def template_kwargs(kwargs: dict[str, Any] | None) -> dict[str, Any]:
    """A request's chat_template_kwargs, as the template's extra variables."""
    if not kwargs:
        return {}
    reserved = sorted(RESERVED_KWARGS & set(kwargs))
    if reserved:
        raise InvalidRequest(
            "chat_template_kwargs",
            f"{', '.join(reserved)} cannot be set here (a request field or the server's own)",
        )
    return dict(kwargs)
