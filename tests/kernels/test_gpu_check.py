"""tools/gpu-check --dry-run: validates its plan and runs every check on tiny shapes, with
the modules the GPU machine lacks (orjson, zmq, fastapi, ...) made unimportable."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton", reason="triton is not installed (pip install triton)")

from tools.gpu_check.cli import FORBIDDEN_MODULES  # noqa: E402
from tools.gpu_check.plan import Plan, memory_estimate, plan_problems  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]

# None in sys.modules makes `import name` raise ImportError, as on the GPU machine
_RUN_BLOCKED = """
import runpy, sys
for name in {names!r}:
    sys.modules[name] = None
sys.argv = ["tools/gpu-check", "--dry-run", "--out", {out!r}]
runpy.run_path({script!r}, run_name="__main__")
"""


def test_full_plan_is_sound() -> None:
    assert plan_problems(Plan.full()) == []
    assert 4.0 < memory_estimate(Plan.full())["peak"] < 40.0


def test_dry_run_passes_without_the_serving_stack(tmp_path: Path) -> None:
    out = tmp_path / "gpu-check.json"
    code = _RUN_BLOCKED.format(names=FORBIDDEN_MODULES, out=str(out),
                               script=str(ROOT / "tools" / "gpu-check"))  # fmt: skip
    # the tool itself turns the interpreter on when there is no CUDA
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert doc["ok"] and doc["dry_run"] and doc["errors"] == []
    assert doc["forbidden_modules_imported"] == []
    kernels = {row["kernel"] for row in doc["kernels"]}
    assert kernels == {"paged_decode", "extend_attention", "kv_store", "rotary", "rmsnorm+residual",
                       "gguf_matmul", "int8_matmul", "lora"}  # fmt: skip
    formats = {row["format"] for row in doc["quant_speed"]}
    assert formats == {"Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K", "W8A8"}
    assert doc["parity"]["ok"] and doc["parity"]["tokens"] > 0
    assert {row["pattern"] for row in doc["lora_speed"]} == {"round-robin", "segments"}
    for section in ("decode_bandwidth", "extend_speed", "quant_speed", "lora_speed"):
        assert doc[section] and all(row["dtype"] == "float32" for row in doc[section])
    assert [s["batch"] for s in doc["cuda_graphs"]["steps"]] == [1, 2]
