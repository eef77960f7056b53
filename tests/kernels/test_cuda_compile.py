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
QUANT_KERNELS = ("_gguf_matmul_kernel", "_int8_matmul_kernel", "_quantize_rows_kernel",
                 "_mxfp4_matmul_kernel")  # fmt: skip
LORA_KERNELS = ("_lora_shrink_kernel", "_lora_expand_kernel", "_sgmv_shrink_kernel",
                "_sgmv_expand_kernel")  # fmt: skip
MOE_KERNELS = ("_moe_gate_up_kernel", "_moe_down_kernel")


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
             "_store_kv_kernel", "_rms_norm_kernel", "_rotary_kernel", *QUANT_KERNELS,
             *LORA_KERNELS, *MOE_KERNELS)  # fmt: skip
    assert kernels == {(name, arch) for name in names for arch in (90, 80)}
    assert max(r["shared_bytes"] for r in rows) <= MAX_SHARED_BYTES
    # a quantized KV cache (int8 rows with their scale, fp8 e4m3 and e5m2): the decode,
    # extend and store kernels of each kind, for each architecture and dtype
    kv = {(r["kernel"], r["arch"], r["KV_KIND"]) for r in rows if r.get("KV_KIND", "0") != "0"}
    attention = ("_decode_split_kernel", "_extend_kernel", "_store_kv_kernel")
    assert kv == {(k, arch, kind) for k in attention for arch in (90, 80) for kind in "234"}
    # every GGUF type in its decode and prefill tiles, for each architecture and dtype
    gguf = [(r["arch"], r["dtype"], r["qtype"]) for r in rows if "qtype" in r]
    assert len(gguf) == len(set(gguf)) * 2 and len({q for _, _, q in gguf}) == 8
    # each LoRA kernel for 1, 2 and 3 slices at each rank, per architecture and dtype
    lora = [(r["kernel"], r["arch"], r["dtype"], r["NUM_SLICES"], r["rank"]) for r in rows
            if r["kernel"] in LORA_KERNELS]  # fmt: skip
    assert len(lora) == len(set(lora)) and {n for *_, n, _ in lora} == {"1", "2", "3"}
    # the quantized GEMMs and LoRA keep every value in registers (`stack_bytes` holds spills)
    quant = [r for r in rows if r["kernel"] in QUANT_KERNELS + LORA_KERNELS + MOE_KERNELS]
    assert [r for r in quant if r["stack_bytes"]] == [] and max(
        r["registers"] for r in quant
    ) <= 255
