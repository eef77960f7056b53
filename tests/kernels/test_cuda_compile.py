"""Every kernel compiles for Hopper (sm_90) and Ampere (sm_80) with Triton's own ptxas, no GPU
needed: what the interpreter cannot check (tile sizes for tl.dot, types, shared memory)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton", reason="triton is not installed (pip install triton)")

ROOT = Path(__file__).resolve().parents[2]
# the smallest opt-in shared memory per block among the GPUs we target (sm_86/sm_89: 99 KB)
MAX_SHARED_BYTES = 99 * 1024


def test_kernels_compile_for_sm90_and_sm80() -> None:
    env = {**os.environ, "TRITON_INTERPRET": "0", "TRITON_DEFAULT_FP_FUSION": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "tests.kernels.cuda_compile", "90", "80"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = [json.loads(line) for line in proc.stdout.splitlines()]
    kernels = {(r["kernel"], r["arch"]) for r in rows}
    names = ("_decode_split_kernel", "_decode_merge_kernel", "_extend_kernel",
             "_store_kv_kernel", "_rms_norm_kernel", "_rotary_kernel")  # fmt: skip
    assert kernels == {(name, arch) for name in names for arch in (90, 80)}
    assert max(r["shared_bytes"] for r in rows) <= MAX_SHARED_BYTES
