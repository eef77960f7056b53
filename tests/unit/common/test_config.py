"""Config: flags beat SHUTTLE_* env vars beat defaults; bad values fail at start-up."""

from __future__ import annotations

import argparse

import pytest

from common.config import Config, ConfigError, add_flags, from_args


def _parse(argv: list[str], env: dict[str, str] | None = None) -> Config:
    parser = argparse.ArgumentParser()
    add_flags(parser)
    return from_args(parser.parse_args(argv), env or {})


def test_defaults() -> None:
    cfg = _parse([])
    assert cfg == Config()
    assert cfg.server.host == "127.0.0.1"


def test_flag_beats_env_beats_default() -> None:
    env = {"SHUTTLE_MAX_NUM_SEQS": "4", "SHUTTLE_BLOCK_SIZE": "32", "SHUTTLE_DTYPE": "bfloat16"}
    cfg = _parse(["--max-num-seqs", "8"], env)
    assert cfg.scheduler.max_num_seqs == 8
    assert cfg.cache.block_size == 32
    assert cfg.model.dtype == "bfloat16"


@pytest.mark.parametrize(
    "argv,env,field",
    [
        (["--block-size", "12"], {}, "block-size"),
        (["--max-num-seqs", "0"], {}, "max-num-seqs"),
        (["--dtype", "float8"], {}, "dtype"),
        ([], {"SHUTTLE_PORT": "eighty"}, "SHUTTLE_PORT"),
        ([], {"SHUTTLE_PORT": "70000"}, "port"),
        (["--http-keep-alive-timeout", "0"], {}, "http-keep-alive-timeout"),
    ],
)
def test_bad_values_name_the_setting(argv: list[str], env: dict[str, str], field: str) -> None:
    with pytest.raises(ConfigError, match=field):
        _parse(argv, env)


def test_keep_alive_outlasts_client_pools() -> None:
    """A client pool reuses an idle connection until its own expiry: the server must keep it
    open longer, or a request sent as the server closes it is cut with no response (and no log
    line on the server). httpx (the openai client's pool) keeps idle connections 5 s, aiohttp
    15 s; uvicorn's own default, 5 s, races httpx's."""
    httpx = pytest.importorskip("httpx")
    timeout = Config().server.http_keep_alive_timeout
    assert timeout > 15.0
    assert timeout > (httpx.Limits().keepalive_expiry or 0.0)


def test_json_round_trip_and_addresses(tmp_path) -> None:  # type: ignore[no-untyped-def]
    cfg = _parse(["--run-dir", str(tmp_path), "--num-tokenizers", "3"])
    assert Config.from_json(cfg.to_json()) == cfg
    assert cfg.addr("scheduler") == f"ipc://{tmp_path}/scheduler.sock"
    assert len(cfg.tokenizer_addrs()) == 3
    tcp = _parse(
        ["--scheduler-addr", "tcp://10.0.0.2:5551", "--tokenizer-addrs", "tcp://a:1, tcp://b:2"]
    )
    assert tcp.addr("scheduler") == "tcp://10.0.0.2:5551"
    assert tcp.tokenizer_addrs() == ["tcp://a:1", "tcp://b:2"]


def test_config_file_is_read_back(tmp_path) -> None:  # type: ignore[no-untyped-def]
    cfg = _parse(["--run-dir", str(tmp_path), "--max-num-batched-tokens", "64"])
    path = tmp_path / "config.json"
    path.write_bytes(cfg.to_json())
    again = _parse(["--config-file", str(path)], {"SHUTTLE_MAX_NUM_BATCHED_TOKENS": "999"})
    assert again == cfg  # the file is already resolved: env does not apply twice


def test_served_model_names_as_vllm_takes_them() -> None:
    cfg = _parse(["--served-model-name", "main", "alias"])
    assert cfg.model.served_model_names == ["main", "alias"]
    assert Config.from_json(cfg.to_json()) == cfg
    env = _parse([], {"SHUTTLE_SERVED_MODEL_NAME": "a, b"})
    assert env.model.served_model_names == ["a", "b"]
    assert _parse([]).model.served_model_names == []  # the folder's name, resolved later
    with pytest.raises(ConfigError, match="served-model-name"):
        _parse(["--served-model-name", "a", "a"])
