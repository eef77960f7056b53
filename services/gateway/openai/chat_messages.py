"""Chat messages of a request: text content (a string, or text parts joined), and the tool
turns of a conversation with tools: an assistant message's `tool_calls` (its content may then
be null or absent) and a `tool` message's `tool_call_id`. services/gateway/openai/tools.py
renders them."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator
from pydantic_core import PydanticCustomError

_STRICT = ConfigDict(strict=True, extra="ignore")


def _refuse(message: str) -> PydanticCustomError:
    return PydanticCustomError("unsupported", message)


def _content_text(value: Any) -> str:
    """A message's content as one string: a string, or the texts of its parts joined."""
    if isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise PydanticCustomError("content_type", "must be a string or a list of text parts")
    texts = []
    for i, part in enumerate(value):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind != "text" or not isinstance(part.get("text"), str):
            raise PydanticCustomError(
                "content_part",
                'part {index} must be {"type": "text", "text": <string>}; '
                "only text parts are supported",
                {"index": i},
            )
        texts.append(part["text"])
    return "\n".join(texts)


class ToolCallFunction(BaseModel):
    model_config = _STRICT
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCallItem(BaseModel):
    """One call of an assistant message's `tool_calls` (a follow-up turn)."""

    model_config = _STRICT
    id: str | None = None
    type: Literal["function"] = "function"
    function: ToolCallFunction


class ChatMessage(BaseModel):
    """One chat message; content is normalised to a string (null only for an assistant
    message with tool_calls)."""

    model_config = _STRICT
    role: Literal["system", "developer", "user", "assistant", "tool"]
    tool_calls: list[ToolCallItem] | None = None  # assistant (validated before content)
    # absent or null only beside tool_calls (as OpenAI's assistant message)
    content: str | None = Field(default=None, validate_default=True)
    name: str | None = None
    tool_call_id: str | None = None  # tool

    @field_validator("tool_calls")
    @classmethod
    def _assistant_calls(cls, value: Any, info: ValidationInfo) -> Any:
        if value and info.data.get("role") != "assistant":
            raise _refuse("only assistant messages have tool_calls")
        return value

    @field_validator("content", mode="before")
    @classmethod
    def _check_content(cls, value: Any, info: ValidationInfo) -> str | None:
        if value is not None:
            return _content_text(value)
        if info.data.get("role") == "assistant" and info.data.get("tool_calls"):
            return None
        raise PydanticCustomError(
            "content_type", "must be a string or a list of text parts (null only beside tool_calls)"
        )

    def as_dict(self) -> dict[str, Any]:
        # "developer" is OpenAI's newer name for "system"; chat templates know only "system"
        role = "system" if self.role == "developer" else self.role
        out: dict[str, Any] = {"role": role, "content": self.content}
        if self.name is not None:
            out["name"] = self.name
        if self.tool_calls:
            out["tool_calls"] = [c.model_dump() for c in self.tool_calls]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        return out
