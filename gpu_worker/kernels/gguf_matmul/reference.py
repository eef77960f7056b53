"""GGUF block dequantization in torch (gguf-py's semantics, any device) and the float32 matmul
that is the ground truth for `kernel.gguf_matmul`."""

from __future__ import annotations

import torch

# ggml type id: (elements per block, bytes per block), as gguf.GGML_QUANT_SIZES
Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K = 2, 3, 6, 7, 8, 12, 13, 14
GGUF_BLOCKS: dict[int, tuple[int, int]] = {
    Q4_0: (32, 18), Q4_1: (32, 20), Q5_0: (32, 22), Q5_1: (32, 24), Q8_0: (32, 34),
    Q4_K: (256, 144), Q5_K: (256, 176), Q6_K: (256, 210),
}  # fmt: skip
QTYPE_NAMES = {Q4_0: "Q4_0", Q4_1: "Q4_1", Q5_0: "Q5_0", Q5_1: "Q5_1", Q8_0: "Q8_0",
               Q4_K: "Q4_K", Q5_K: "Q5_K", Q6_K: "Q6_K"}  # fmt: skip


def row_bytes(qtype: int, k: int) -> int:
    """Bytes of one weight row of k elements; k must be a whole number of blocks."""
    block, size = GGUF_BLOCKS[qtype]
    assert k % block == 0, f"{QTYPE_NAMES[qtype]} rows hold multiples of {block}, got {k}"
    return k // block * size


def _f16(b: torch.Tensor) -> torch.Tensor:  # [n, 2] uint8 -> [n, 1] float32
    return b.contiguous().view(torch.float16).float()


def _nibbles(qs: torch.Tensor, group: int) -> torch.Tensor:
    """[n, B] bytes -> [n, 2B] values: per group of `group` bytes, low nibbles then high."""
    n = qs.shape[0]
    shifts = torch.tensor([0, 4], dtype=torch.uint8, device=qs.device).reshape(1, 1, 2, 1)
    q = qs.reshape(n, -1, 1, group) >> shifts
    return (q & 0x0F).reshape(n, -1)


def _bits(b: torch.Tensor, width: int, group: int) -> torch.Tensor:
    """[n, B] bytes -> [n, B * 8 / width]: per group, field 0 of each byte, then field 1..."""
    n = b.shape[0]
    shifts = torch.arange(0, 8, width, dtype=torch.uint8, device=b.device).reshape(1, 1, -1, 1)
    return ((b.reshape(n, -1, 1, group) >> shifts) & ((1 << width) - 1)).reshape(n, -1)


def _legacy(qtype: int, b: torch.Tensor) -> torch.Tensor:
    d = _f16(b[:, 0:2])
    if qtype == Q8_0:
        return d * b[:, 2:].contiguous().view(torch.int8).float()
    has_min = qtype in (Q4_1, Q5_1)
    m = _f16(b[:, 2:4]) if has_min else None
    at = 4 if has_min else 2
    if qtype in (Q5_0, Q5_1):
        bit = torch.arange(8, dtype=torch.uint8, device=b.device)
        # bit j of the little-endian uint32: byte j / 8, bit j % 8
        high = ((b[:, at : at + 4, None] >> bit) & 1).reshape(-1, 32) << 4
        q = _nibbles(b[:, at + 4 :], 16) | high
    else:
        q = _nibbles(b[:, at:], 16)
    if m is not None:
        return d * q.float() + m
    return d * (q.float() - (16.0 if qtype == Q5_0 else 8.0))


def _k_scale_min(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """12 packed bytes -> 8 six-bit scales and 8 six-bit mins (gguf-py Q4_K.get_scale_min)."""
    d, m, md = s[:, 0:4], s[:, 4:8], s[:, 8:12]
    sc = torch.cat([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], dim=1)
    mn = torch.cat([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], dim=1)
    return sc.float(), mn.float()


def _k_quant(qtype: int, b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    if qtype == Q6_K:
        q = _nibbles(b[:, 0:128], 64) | (_bits(b[:, 128:192], 2, 32) << 4)
        scales = b[:, 192:208].contiguous().view(torch.int8).float()
        d = _f16(b[:, 208:210]) * scales  # [n, 16]
        return (d.reshape(n, 16, 1) * (q.float() - 32.0).reshape(n, 16, 16)).reshape(n, 256)
    d, dmin = _f16(b[:, 0:2]), _f16(b[:, 2:4])
    sc, mn = _k_scale_min(b[:, 4:16])
    if qtype == Q4_K:
        q = _nibbles(b[:, 16:144], 32)
    else:
        q = _nibbles(b[:, 48:176], 32) | (_bits(b[:, 16:48], 1, 32) << 4)
    w = (d * sc).reshape(n, 8, 1) * q.float().reshape(n, 8, 32) - (dmin * mn).reshape(n, 8, 1)
    return w.reshape(n, 256)


def dequantize_reference(weight: torch.Tensor, qtype: int, k: int) -> torch.Tensor:
    """uint8 [N, row_bytes] in the GGUF block format `qtype` -> float32 [N, k]."""
    block, size = GGUF_BLOCKS[qtype]
    assert weight.dtype == torch.uint8 and weight.shape[1] == row_bytes(qtype, k)
    blocks = weight.reshape(-1, size)
    values = _k_quant(qtype, blocks) if block == 256 else _legacy(qtype, blocks)
    return values.reshape(weight.shape[0], k)


# byte offsets of each block's fp16 scale fields (d, and dmin or m): the rest is quants
_F16_FIELDS = {Q4_0: (0,), Q5_0: (0,), Q8_0: (0,), Q4_1: (0, 2), Q5_1: (0, 2), Q4_K: (0, 2),
               Q5_K: (0, 2), Q6_K: (208,)}  # fmt: skip


def random_gguf_weight(
    qtype: int, n: int, k: int, *, seed: int, scale: float, device: str | torch.device = "cpu"
) -> torch.Tensor:
    """Valid random blocks [n, row_bytes] uint8: random quant bytes, finite fp16 scales drawn
    from N(0, scale) (gguf-py cannot quantize K-quants; any bytes but the scales are valid)."""
    _, size = GGUF_BLOCKS[qtype]
    gen = torch.Generator().manual_seed(seed)
    blocks = torch.randint(0, 256, (n * row_bytes(qtype, k) // size, size), generator=gen,
                           dtype=torch.uint8)  # fmt: skip
    for at in _F16_FIELDS[qtype]:
        d = (torch.randn(blocks.shape[0], 1, generator=gen) * scale).to(torch.float16)
        blocks[:, at : at + 2] = d.view(torch.uint8)
    return blocks.reshape(n, -1).to(device)


def gguf_matmul_reference(
    x: torch.Tensor,  # [M, K]
    weight: torch.Tensor,  # [N, row_bytes] uint8
    qtype: int,
) -> torch.Tensor:  # [M, N] float32
    """x @ dequantize(weight)^T in float32."""
    return x.float() @ dequantize_reference(weight, qtype, x.shape[1]).t()
