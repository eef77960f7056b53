"""Compile every kernel for a CUDA architecture without a GPU (Triton's bundled ptxas).

    TRITON_INTERPRET=0 python -m tests.kernels.cuda_compile 90 80

The interpreter runs kernels as Python and so misses what only the compiler checks (tl.dot
tile sizes, types, shared memory). This compiles the launch configurations the launchers
pick, for the model shapes of tools/gpu-check, and prints one JSON line per kernel with
its shared memory, registers per thread and stack (local memory: spills) from Triton's
bundled cuobjdump. Must run in a process where TRITON_INTERPRET is unset or 0.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tempfile
import time
from typing import Any

from triton import knobs
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.compiler import compile as triton_compile

from gpu_worker.kernels import dot_precision, next_power_of_2
from gpu_worker.kernels.extend_attention import kernel as extend
from gpu_worker.kernels.fused_moe import kernel as moe
from gpu_worker.kernels.gguf_matmul import kernel as gguf
from gpu_worker.kernels.gguf_matmul.reference import GGUF_BLOCKS, QTYPE_NAMES
from gpu_worker.kernels.int8_matmul import kernel as int8
from gpu_worker.kernels.kv_store import kernel as kv_store
from gpu_worker.kernels.lora import kernel as lora
from gpu_worker.kernels.mxfp4_matmul import kernel as mxfp4
from gpu_worker.kernels.paged_decode import kernel as decode
from gpu_worker.kernels.rmsnorm import kernel as rmsnorm
from gpu_worker.kernels.rotary import kernel as rotary

DTYPES = {"bf16": 2, "fp32": 4}  # name: element size
SHAPES = ((9, 3, 64), (32, 8, 128))  # heads, KV heads, head_dim
FLOAT_ARGS = ("qk_scale", "eps", "softcap")


def _resources(cubin: bytes) -> dict[str, int]:
    """Registers per thread and stack bytes per thread (spills live there) of one kernel."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        usage = subprocess.run([knobs.nvidia.cuobjdump.path, "-res-usage", f.name],
                               capture_output=True, text=True, check=True).stdout  # fmt: skip
    found = re.search(r"REG:(\d+) STACK:(\d+)", usage)
    assert found, usage
    return {"registers": int(found[1]), "stack_bytes": int(found[2])}


def _compile(fn: Any, arch: int, pointers: dict[str, str], constexprs: dict[str, Any],
             aligned: tuple[str, ...] = (), **options: int) -> dict[str, Any]:  # fmt: skip
    """`aligned`: arguments the launcher's JIT sees 16-byte aligned / divisible by 16 (torch
    allocations, hidden sizes), as it specializes them at run time."""
    signature = {
        name: "constexpr" if name in constexprs
        else pointers.get(name, "fp32" if name in FLOAT_ARGS else "i32")
        for name in fn.arg_names
    }  # fmt: skip
    attrs = {(fn.arg_names.index(a),): [["tt.divisibility", 16]] for a in aligned}
    start = time.monotonic()
    source = ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)
    compiled = triton_compile(source, target=GPUTarget("cuda", arch, 32), options=options)
    seconds = round(time.monotonic() - start, 1)
    return {"kernel": fn.__name__, "arch": arch, **{k: str(v) for k, v in constexprs.items()},
            "shared_bytes": compiled.metadata.shared, **_resources(compiled.asm["cubin"]),
            "s": seconds}  # fmt: skip


# a quantized KV cache's kinds (gpu_worker/kv_quant.py) and the cache's element type
KV_KINDS = {2: "i8", 3: "u8", 4: "u8"}  # int8 rows with their scale, fp8 e4m3, fp8 e5m2


def _attention(arch: int, dt: str, heads: int, kv_heads: int, head_dim: int,
               kv_kind: int = 0) -> list[dict]:  # fmt: skip
    import torch

    dtype = torch.float32 if dt == "fp32" else torch.bfloat16
    precision = dot_precision(dtype)
    block_h, block_n, block_d = decode.decode_tiles(heads // kv_heads, head_dim, DTYPES[dt])
    cache_dt = KV_KINDS.get(kv_kind, dt)
    cache = {"cache_ptr": f"*{cache_dt}", "block_tables_ptr": "*i32", "seq_lens_ptr": "*i32"}
    split = {"q_ptr": f"*{dt}", "part_o_ptr": "*fp32", "part_lse_ptr": "*fp32", **cache}
    merge = {"part_o_ptr": "*fp32", "part_lse_ptr": "*fp32", "seq_lens_ptr": "*i32",
             "sinks_ptr": "*fp32", "out_ptr": f"*{dt}"}  # fmt: skip
    block_m, ext_n, _ = extend.extend_tiles(head_dim, DTYPES[dt])
    ext = {"q_ptr": f"*{dt}", "out_ptr": f"*{dt}", "query_start_loc_ptr": "*i32",
           "sinks_ptr": "*fp32", **cache}  # fmt: skip
    tiles = dict(NUM_SPLITS=16, BLOCK_N=block_n, BLOCK_D=block_d)
    return [
        _compile(decode._decode_split_kernel, arch, split,
                 dict(**tiles, BLOCK_H=block_h, DOT_PRECISION=precision, KV_KIND=kv_kind),
                 num_warps=4, num_stages=2),
        # with attention sinks (gpt-oss), the variant with the most live values
        _compile(decode._decode_merge_kernel, arch, merge, dict(**tiles, HAS_SINKS=True),
                 num_warps=4),
        _compile(extend._extend_kernel, arch, ext,
                 dict(BLOCK_M=block_m, BLOCK_N=ext_n, BLOCK_D=block_d, DOT_PRECISION=precision,
                      HAS_SINKS=True, KV_KIND=kv_kind),
                 num_warps=4, num_stages=2),
    ]  # fmt: skip


def _elementwise(arch: int, dt: str) -> list[dict]:
    heads, kv_heads, head_dim = SHAPES[-1]
    kv = {"k_ptr": f"*{dt}", "v_ptr": f"*{dt}", "cache_ptr": f"*{dt}", "slot_ptr": "*i64"}
    norm = {n: f"*{dt}" for n in ("x_ptr", "residual_ptr", "weight_ptr", "out_ptr",
                                  "residual_out_ptr")}  # fmt: skip
    rope = {"positions_ptr": "*i64", "q_ptr": f"*{dt}", "k_ptr": f"*{dt}", "cos_ptr": "*fp32",
            "sin_ptr": "*fp32"}  # fmt: skip
    return [
        _compile(kv_store._store_kv_kernel, arch, kv,
                 dict(BLOCK_H=next_power_of_2(kv_heads), BLOCK_D=head_dim, KV_KIND=0)),
        _compile(rmsnorm._rms_norm_kernel, arch, norm, dict(HAS_RESIDUAL=True, BLOCK=4096),
                 num_warps=16),
        _compile(rotary._rotary_kernel, arch, rope,
                 dict(HAS_K=True, BLOCK_HQ=heads, BLOCK_HK=kv_heads, BLOCK_HALF=head_dim // 2)),
    ]  # fmt: skip


def _quantized_kv(arch: int, dt: str) -> list[dict]:
    """The attention kernels reading, and the store quantizing, each quantized KV kind
    (the largest shape: head_dim 128)."""
    heads, kv_heads, head_dim = SHAPES[-1]
    rows = []
    for kind, cache_dt in KV_KINDS.items():
        rows += _attention(arch, dt, heads, kv_heads, head_dim, kind)
        kv = {"k_ptr": f"*{dt}", "v_ptr": f"*{dt}", "cache_ptr": f"*{cache_dt}",
              "slot_ptr": "*i64"}  # fmt: skip
        rows.append(_compile(kv_store._store_kv_kernel, arch, kv,
                             dict(BLOCK_H=next_power_of_2(kv_heads), BLOCK_D=head_dim,
                                  KV_KIND=kind)))  # fmt: skip
    return rows


DECODE_M, PREFILL_M = 8, 64  # the launchers' tiles for M = 1..8 and for M >= 64


def _gguf(arch: int, dt: str) -> list[dict]:
    """Every block type in the decode and the prefill tiles."""
    import torch

    dtype = torch.float32 if dt == "fp32" else torch.bfloat16
    pointers = {"x_ptr": f"*{dt}", "w_ptr": "*u8", "out_ptr": f"*{dt}"}
    # weight rows are K / 32 blocks of 18..210 bytes: no alignment to assume for stride_wn
    aligned = ("x_ptr", "w_ptr", "out_ptr", "K", "stride_xm", "stride_om", "k_per_split")
    rows = []
    for qtype, (qk, type_size) in GGUF_BLOCKS.items():
        for m in (DECODE_M, PREFILL_M):
            block_m, block_n, warps = gguf.gguf_tiles(m, dtype)
            tiles = dict(QTYPE=qtype, QK=qk, TYPE_SIZE=type_size, BLOCK_M=block_m,
                         BLOCK_N=block_n, DOT_PRECISION=dot_precision(dtype))  # fmt: skip
            row = _compile(gguf._gguf_matmul_kernel, arch, pointers, tiles, aligned,
                           num_warps=warps)  # fmt: skip
            rows.append({**row, "qtype": QTYPE_NAMES[qtype]})
    return rows


def _int8(arch: int, dt: str) -> list[dict]:
    """The W8A8 GEMM in the decode and the prefill tiles, and the row quantizer."""
    pointers = {"xq_ptr": "*i8", "x_scale_ptr": "*fp32", "w_ptr": "*i8",
                "w_scale_ptr": "*fp32", "out_ptr": f"*{dt}"}  # fmt: skip
    aligned = (*pointers, "K", "stride_xm", "stride_wn", "stride_om", "k_per_split")
    rows = []
    # decode launches may split K (int32 partials); prefill never does
    for m, split in ((DECODE_M, False), (DECODE_M, True), (PREFILL_M, False)):
        block_m, block_n, block_k, warps, stages = int8.int8_tiles(m)
        tiles = dict(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, SPLIT=split)
        rows.append(_compile(int8._int8_matmul_kernel, arch, pointers, tiles, aligned,
                             num_warps=warps, num_stages=stages))  # fmt: skip
    quant = {"x_ptr": f"*{dt}", "q_ptr": "*i8", "scale_ptr": "*fp32"}
    block = int8.MAX_QUANT_BLOCK
    rows.append(
        _compile(
            int8._quantize_rows_kernel,
            arch,
            quant,
            dict(BLOCK=block),
            (*quant, "stride_x", "stride_q"),
            num_warps=min(8, block // 256),
        )
    )
    return rows  # fmt: skip


LORA_RANKS = (16, 64)  # the usual max_rank and the largest tile (lora_tiles)


def _lora(arch: int, dt: str) -> list[dict]:
    """Decode (bgmv) and prefill (sgmv) shrink and expand for 1, 2 and 3 slices (o/down,
    gate_up, qkv) at each LORA_RANKS."""
    import torch

    dtype = torch.float32 if dt == "fp32" else torch.bfloat16
    precision = dot_precision(dtype)
    groups = {"order_ptr": "*i32", "starts_ptr": "*i32", "counts_ptr": "*i32"}
    shrink = {"x_ptr": f"*{dt}", "a_ptr": f"*{dt}", "slots_ptr": "*i32", "z_ptr": "*fp32"}
    expand = {"z_ptr": "*fp32", "b_ptr": f"*{dt}", "slots_ptr": "*i32", "y_ptr": f"*{dt}"}
    sg_shrink = {"x_ptr": f"*{dt}", "a_ptr": f"*{dt}", "z_ptr": "*fp32", **groups}
    sg_expand = {"z_ptr": "*fp32", "b_ptr": f"*{dt}", "y_ptr": f"*{dt}", **groups}
    rows = []
    for rank in LORA_RANKS:
        block_r, block_k, block_n = lora.lora_tiles(rank)
        sg_m, sg_k, sg_n = lora.sgmv_tiles(dtype, rank)
        sgmv = dict(BLOCK_M=sg_m, DOT_PRECISION=precision)
        for slices in (1, 2, 3):
            tiles = dict(NUM_SLICES=slices, BLOCK_R=block_r)
            new = [
                _compile(lora._lora_shrink_kernel, arch, shrink, dict(**tiles, BLOCK_K=block_k),
                         (*shrink, "K", "R", "stride_xm"), num_warps=4),
                _compile(lora._lora_expand_kernel, arch, expand, dict(**tiles, BLOCK_N=block_n),
                         (*expand, "R", "stride_ym"), num_warps=4),
                _compile(lora._sgmv_shrink_kernel, arch, sg_shrink,
                         dict(**tiles, **sgmv, BLOCK_K=sg_k),
                         (*sg_shrink, "K", "R", "stride_xm"), num_warps=4),
                _compile(lora._sgmv_expand_kernel, arch, sg_expand,
                         dict(**tiles, **sgmv, BLOCK_N=sg_n),
                         (*sg_expand, "R", "stride_ym"), num_warps=4),
            ]  # fmt: skip
            rows += [{**row, "rank": rank} for row in new]
    return rows


def _moe(arch: int, dt: str) -> list[dict]:
    """The fused MoE's gate/up (with the activation) and down launches."""
    import torch

    precision = dot_precision(torch.float32 if dt == "fp32" else torch.bfloat16)
    block_n, block_k, warps = moe.moe_tiles(1024, 2048)
    tiles = dict(BLOCK_M=moe.BLOCK_M, BLOCK_N=block_n, BLOCK_K=block_k, PRECISION=precision)
    ids = {"pair_ids_ptr": "*i32", "block_experts_ptr": "*i32"}
    gate_up = {"x_ptr": f"*{dt}", "w13_ptr": f"*{dt}", "h_ptr": f"*{dt}", **ids}
    down = {"h_ptr": f"*{dt}", "w2_ptr": f"*{dt}", "out_ptr": "*fp32", "weights_ptr": "*fp32",
            **ids}  # fmt: skip
    return [
        _compile(moe._moe_gate_up_kernel, arch, gate_up, tiles, (*gate_up, "hidden", "width",
                 "stride_x", "stride_we", "stride_wn", "stride_h"), num_warps=warps),
        _compile(moe._moe_down_kernel, arch, down, tiles, (*down, "hidden", "width",
                 "stride_h", "stride_we", "stride_wn", "stride_o"), num_warps=warps),
    ]  # fmt: skip


def _mxfp4(arch: int, dt: str) -> list[dict]:
    """The MXFP4 GEMM (gpt-oss's experts) in the decode and the prefill tiles, with a bias."""
    import torch

    dtype = torch.float32 if dt == "fp32" else torch.bfloat16
    pointers = {"x_ptr": f"*{dt}", "blocks_ptr": "*u8", "scales_ptr": "*u8",
                "bias_ptr": f"*{dt}", "out_ptr": f"*{dt}"}  # fmt: skip
    aligned = (*pointers, "K", "stride_xm", "stride_om")
    rows = []
    for m in (DECODE_M, PREFILL_M):
        block_m, block_n, warps = mxfp4.mxfp4_tiles(m, dtype)
        tiles = dict(HAS_BIAS=True, BLOCK_M=block_m, BLOCK_N=block_n,
                     DOT_PRECISION=dot_precision(dtype))  # fmt: skip
        rows.append(_compile(mxfp4._mxfp4_matmul_kernel, arch, pointers, tiles, aligned,
                             num_warps=warps))  # fmt: skip
    return rows


def main(archs: list[int]) -> int:
    for i, arch in enumerate(archs):
        # the first architecture gets every variant, the others the bf16 production ones
        for dt in DTYPES if i == 0 else ("bf16",):
            for shape in SHAPES:
                for row in _attention(arch, dt, *shape):
                    print(json.dumps({"dtype": dt, "shape": list(shape), **row}), flush=True)
            rows = _elementwise(arch, dt) + _gguf(arch, dt) + _int8(arch, dt) + _lora(arch, dt)
            for row in rows + _moe(arch, dt) + _mxfp4(arch, dt):
                print(json.dumps({"dtype": dt, **row}), flush=True)
            for row in _quantized_kv(arch, dt):
                print(json.dumps({"dtype": dt, **row}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main([int(a) for a in sys.argv[1:]] or [90]))
