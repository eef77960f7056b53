"""Every C header of gpu_worker/cpu/ compiles alone (`gcc -fsyntax-only`, the kernels' own
flags, for this CPU and for plain x86-64): each includes what it uses and none needs to be
included partway through another file."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from gpu_worker.cpu.build import build_flags

CPU = Path(__file__).resolve().parents[4] / "gpu_worker" / "cpu"
HEADERS = sorted(CPU.glob("*.h"))
COMPILER = shutil.which("gcc") or shutil.which("cc")

pytestmark = pytest.mark.skipif(COMPILER is None, reason="no C compiler here")


def _syntax_flags(march: str) -> list[str]:
    dropped = ("-shared", "-fPIC", "-lmvec")
    flags = [f"-march={march}" if f == "-march=native" else f for f in build_flags()]
    return [f for f in flags if f not in dropped]


def test_the_headers_are_found() -> None:
    assert {"bf16.h", "gguf.h", "gguf_rows.h", "gguf_gemm.h", "gguf_amx.h"} <= {
        h.name for h in HEADERS
    }


@pytest.mark.parametrize("march", ["native", "x86-64"])
@pytest.mark.parametrize("header", HEADERS, ids=lambda h: h.name)
def test_each_header_compiles_alone(header: Path, march: str, tmp_path: Path) -> None:
    assert COMPILER is not None
    # twice: the include guard must make a second inclusion harmless
    unit = tmp_path / "unit.c"
    unit.write_text(f'#include "{header}"\n#include "{header}"\n')
    cmd = [COMPILER, "-fsyntax-only", "-Wall", "-Werror", *_syntax_flags(march), str(unit)]
    result = subprocess.run(cmd, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
