"""How the tokenizer renders a chat with tools (services/tokenizer/tool_prompt.py): by the
chat template when it reads `tools`, else by the built-in Hermes-style prompt; a template
that renders neither way is the request's 400 on `tools`. No processes: the tokenizer actor's
`tokenize` is called directly on a test-built tokenizer."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from tokenizers import Tokenizer

from common.config import Config
from common.messages import GenerateRequest, SamplingParams
from services.tokenizer.actor import TokenizerActor, startup_model
from services.tokenizer.tool_prompt import builtin_messages, renders_tools, template_messages
from services.tokenizer.validate import InvalidRequest
from tests.tiny_models import OWN_VOCAB_EOS_ID, make_own_vocab_tokenizer

WEATHER = {
    "name": "weather",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
}
CLOCK = {"name": "clock", "description": "now"}
CALLS = [{"id": "c1", "type": "function",
          "function": {"name": "weather", "arguments": '{"city": "Paris"}'}}]  # fmt: skip
CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather?"},
    {"role": "assistant", "content": None, "tool_calls": CALLS},
    {"role": "tool", "tool_call_id": "c1", "content": "21C"},
]
# a tool-aware template in the Hugging Face way: `tools` and the calls' arguments as objects
TOOL_TEMPLATE = (
    "{% if tools %}[tools]{% for t in tools %} {{ t.function.name }}{% endfor %}\n{% endif %}"
    "{% for m in messages %}[{{ m.role }}]"
    "{% if m.tool_calls %}{% for c in m.tool_calls %} call {{ c.function.name }}"
    "({{ c.function.arguments.city }}){% endfor %}{% else %} {{ m.content }}{% endif %}\n"
    "{% endfor %}"
)
# a template with no tool support that drops system messages
NO_SYSTEM = (
    "{% for m in messages if m.role != 'system' %}[{{ m.role }}] {{ m.content }}\n{% endfor %}"
)


def test_which_templates_render_tools() -> None:
    assert renders_tools(TOOL_TEMPLATE)
    assert not renders_tools(NO_SYSTEM) and not renders_tools(None)
    assert not renders_tools("{% if %}")  # rendering will say what is wrong
    assert renders_tools({"default": NO_SYSTEM, "tool_use": NO_SYSTEM})  # a named tool template
    assert not renders_tools({"default": NO_SYSTEM})


def test_the_built_in_prompt_renders_tools_calls_and_results() -> None:
    out = builtin_messages(CONVERSATION, [WEATHER, CLOCK])
    assert out[0]["role"] == "system" and out[0]["content"].startswith("Be brief.\n\n# Tools")
    assert '"name":"weather"' in out[0]["content"] and "<tool_call>" in out[0]["content"]
    assert out[2] == {
        "role": "assistant",
        "content": '<tool_call>\n{"name":"weather","arguments":{"city":"Paris"}}\n</tool_call>',
    }
    assert out[3] == {"role": "user", "content": "<tool_response>\n21C\n</tool_response>"}
    assert builtin_messages(CONVERSATION[1:2], None) == [{"role": "user", "content": "Weather?"}]
    assert builtin_messages(CONVERSATION[1:2], [CLOCK])[0]["role"] == "system"


def test_a_tool_aware_template_gets_the_conversation_with_arguments_as_objects() -> None:
    out = template_messages(CONVERSATION)
    assert out[2]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}
    assert out[3] == CONVERSATION[3] and CALLS[0]["function"]["arguments"] == '{"city": "Paris"}'


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = make_own_vocab_tokenizer(tmp_path_factory.mktemp("model"), vocab_size=300)
    size = Tokenizer.from_file(str(root / "tokenizer.json")).get_vocab_size()
    config = {"vocab_size": size, "eos_token_id": OWN_VOCAB_EOS_ID, "max_position_embeddings": 999}
    (root / "config.json").write_text(json.dumps(config))
    return root


def actor(folder: Path, tmp_path: Path, chat_template: str = "") -> TokenizerActor:
    server = {"run_dir": str(tmp_path), "chat_template": chat_template}
    out = TokenizerActor(Config().replace(model={"model": str(folder)}, server=server), 0)
    out.model = startup_model(folder)
    return out


def text_of(actor: TokenizerActor, **fields: Any) -> str:
    req = GenerateRequest(
        request_id="r", model="tiny", sampling=SamplingParams(4), messages=CONVERSATION, **fields
    )
    ids = actor.tokenize(req).prompt_token_ids
    return str(actor.model.tokenizer.decode(ids))


def test_the_models_template_without_tool_support_gets_the_built_in_prompt(
    folder: Path, tmp_path: Path
) -> None:
    text = text_of(actor(folder, tmp_path), tools=[WEATHER, CLOCK])  # ChatML, no tools
    assert "# Tools" in text and '"name":"clock"' in text and "<tool_response>" in text


def test_a_tool_aware_template_renders_the_tools_itself(folder: Path, tmp_path: Path) -> None:
    text = text_of(actor(folder, tmp_path, TOOL_TEMPLATE), tools=[WEATHER, CLOCK])
    assert text.startswith("[tools] weather clock[system]") and "call weather(Paris)" in text
    assert "# Tools" not in text and "[tool] 21C" in text
    # a follow-up turn without tools renders the calls the same way
    assert "call weather(Paris)" in text_of(actor(folder, tmp_path, TOOL_TEMPLATE))


def test_a_template_that_cannot_render_the_tools_is_a_400_on_tools(
    folder: Path, tmp_path: Path
) -> None:
    with pytest.raises(InvalidRequest) as refused:
        text_of(actor(folder, tmp_path, NO_SYSTEM), tools=[WEATHER])
    assert refused.value.param == "tools" and refused.value.status == 400
    assert "'weather'" in refused.value.message
    ignores = "{% for m in messages %}{{ m.content }}{% endfor %}{{ tools | length }}"
    with pytest.raises(InvalidRequest) as refused:
        text_of(actor(folder, tmp_path, ignores), tools=[WEATHER])
    assert refused.value.param == "tools"
    raising = "{% if tools %}{{ raise_exception('no tools here') }}{% endif %}"
    with pytest.raises(InvalidRequest) as refused:
        text_of(actor(folder, tmp_path, raising), tools=[WEATHER])
    assert refused.value.param == "tools" and "no tools here" in refused.value.message
    # without tools, the same templates serve
    assert "Weather?" in text_of(actor(folder, tmp_path, NO_SYSTEM))
