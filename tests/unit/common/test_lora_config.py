"""LoRA flags: vLLM's names and forms; a bad value fails at start-up naming the flag."""

from __future__ import annotations

import argparse

import pytest

from common.config import Config, ConfigError, add_flags, from_args
from common.lora_config import LoraConfig, LoraModule, parse_lora_modules


def _parse(argv: list[str], env: dict[str, str] | None = None) -> Config:
    parser = argparse.ArgumentParser()
    add_flags(parser)
    return from_args(parser.parse_args(argv), env or {})


def test_defaults_as_vllm() -> None:
    lora = _parse([]).lora
    assert (lora.enable_lora, lora.max_loras, lora.max_lora_rank) == (False, 1, 16)
    assert lora.cpu_loras == 1 and lora.modules == []


def test_both_forms_of_lora_modules() -> None:
    cfg = _parse(
        [
            "--enable-lora",
            "--lora-modules",
            "sql=/a/sql",
            '{"name": "chat", "path": "/a/b,c", "base_model_name": "base"}',
            "--max-loras",
            "4",
        ]
    )
    assert cfg.lora.modules == [LoraModule("sql", "/a/sql"), LoraModule("chat", "/a/b,c", "base")]
    assert cfg.lora.max_loras == 4 and cfg.lora.cpu_loras == 4
    assert Config.from_json(cfg.to_json()) == cfg  # the supervisor's round trip


def test_env_var_form() -> None:
    env = {"SHUTTLE_ENABLE_LORA": "1", "SHUTTLE_LORA_MODULES": "a=/x b=/y"}
    assert [m.name for m in _parse([], env).lora.modules] == ["a", "b"]


@pytest.mark.parametrize(
    "kwargs,names",
    [
        ({"lora_modules": "a=/x"}, ("--lora-modules", "--enable-lora")),
        ({"enable_lora": True, "max_loras": 0}, ("--max-loras",)),
        ({"enable_lora": True, "max_lora_rank": 12}, ("--max-lora-rank",)),
        ({"enable_lora": True, "max_loras": 4, "max_cpu_loras": 2}, ("--max-cpu-loras",)),
        ({"enable_lora": True, "lora_modules": "a"}, ("--lora-modules", "name=path")),
        ({"enable_lora": True, "lora_modules": "a=/x a=/y"}, ("given twice",)),
        ({"enable_lora": True, "lora_modules": '{"name": "a"}'}, ("'path'",)),
        ({"enable_lora": True, "lora_modules": '{"name": "a", "path": "/x", "z": 1}'}, ("'z'",)),
        ({"enable_lora": True, "lora_modules": '{"name": "a",'}, ("not valid JSON",)),
    ],
)
def test_bad_values_name_the_flag(kwargs: dict[str, object], names: tuple[str, ...]) -> None:
    with pytest.raises(ConfigError) as e:
        LoraConfig(**kwargs)  # type: ignore[arg-type]
    for name in names:
        assert name in str(e.value)


def test_lora_modules_without_enable_lora_from_flags() -> None:
    with pytest.raises(ConfigError, match="--enable-lora"):
        _parse(["--lora-modules", "a=/x"])


def test_parse_skips_blank_lines() -> None:
    assert parse_lora_modules("\n a=/x \n\n") == [LoraModule("a", "/x")]
