"""--dtype auto: bfloat16 only where the CPU has native bf16 arithmetic (or on CUDA)."""

from __future__ import annotations

from pathlib import Path

import pytest

from common.config import Config, ConfigError
from common.cpu_features import auto_dtype, cpu_flags


def test_auto_picks_bfloat16_only_with_native_support() -> None:
    avx2 = frozenset({"sse4_2", "avx2", "fma"})
    assert auto_dtype("cpu", avx2) == "float32"
    assert auto_dtype("cpu", avx2 | {"avx512f", "avx512_vnni"}) == "float32"
    assert auto_dtype("cpu", avx2 | {"avx512f", "avx512_bf16"}) == "bfloat16"
    assert auto_dtype("cpu", avx2 | {"amx_tile", "amx_bf16"}) == "bfloat16"
    assert auto_dtype("cuda", frozenset()) == "bfloat16"


def test_flags_are_read_from_cpuinfo(tmp_path: Path) -> None:
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nflags\t\t: fpu avx2 avx512_bf16\nprocessor\t: 1\n")
    assert cpu_flags(str(info)) == {"fpu", "avx2", "avx512_bf16"}
    assert cpu_flags(str(tmp_path / "missing")) == frozenset()


def test_the_config_resolves_auto_and_keeps_explicit_choices() -> None:
    cfg = Config().replace(model={"dtype": "auto"})
    assert cfg.model.resolved_dtype == auto_dtype("cpu")
    assert Config().model.resolved_dtype == "float32"  # the default never picks bf16 itself
    assert Config().replace(model={"dtype": "bfloat16"}).model.resolved_dtype == "bfloat16"
    with pytest.raises(ConfigError, match="dtype"):
        Config().replace(model={"dtype": "float16"})
