"""The CPU paged-decode kernel (paged_decode.c): built once with gcc, called via ctypes.

The eager torch path gathers every decode's blocks into a buffer padded to the longest
sequence and runs SDPA over it: each step copies the KV once and reads it twice, and short
sequences pay for the longest. The C kernel reads each sequence's own K/V rows in place,
once, with torch's OpenMP threads (the process's libgomp is reused: same soname).

The shared library is built at first use (gpu_worker/cpu/build.py). Without gcc, or if the
build fails, `paged_decode` returns None and the torch attention backend
(gpu_worker/attention/torch_backend.py) keeps its eager path.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from gpu_worker.cpu.build import KernelLibrary
from gpu_worker.kv_quant import KVFormat

SOURCE = Path(__file__).with_name("paged_decode.c")
SMALL_WORK = 1 << 18  # K (and as many V) elements below which one thread attends
_P = ctypes.c_void_p
_I = ctypes.c_int


def _declare(lib: ctypes.CDLL) -> None:
    lib.paged_decode.restype = _I
    lib.paged_decode.argtypes = [_P, _P, _P, _I, _P, _I, _P, _I, _I, _I, _I, _I]
    lib.paged_decode.argtypes += [ctypes.c_float, _I, ctypes.c_float, _P, _P, _I]
    lib.paged_prefill.restype = _I
    lib.paged_prefill.argtypes = [_P, _P, _P, _I, _P, _I, _I, _I, _I, _I, _I]
    lib.paged_prefill.argtypes += [ctypes.c_float, _I, ctypes.c_float, _P, _P, _I]


_LIBRARIES: dict[str, KernelLibrary] = {}


def load(march: str = "native") -> ctypes.CDLL | None:
    """The kernel library built for `march` ("native": this CPU's instruction set; tests also
    build "haswell", AVX2 only), built on first use, or None when it cannot be had."""
    if march not in _LIBRARIES:
        what = "CPU paged-decode kernel" + ("" if march == "native" else f" ({march})")
        includes = (Path(__file__).with_name("bf16.h"),)
        _LIBRARIES[march] = KernelLibrary(SOURCE, _declare, what, includes, march)
    return _LIBRARIES[march].load()


def _cache_format(kv_cache: torch.Tensor, kv_format: KVFormat | None) -> KVFormat | None:
    """How the cache's rows are stored (`kv_format`, or kv_cache's dtype when that is None or
    not quantized), or None when the kernel cannot read them."""
    if kv_format is None or not kv_format.quantized:
        if kv_cache.dtype not in (torch.float32, torch.bfloat16):
            return None
        return KVFormat.create("auto", kv_cache.dtype)
    return kv_format if kv_cache.dtype == kv_format.storage_dtype else None


class _Call:
    """What both entry points share: the library, the cache's format, q as float32, the
    output, the sinks, the shapes; `run` passes the common arguments around an entry's own
    (its rows' tables and lengths) and gives the output in q's dtype, or None."""

    def __init__(
        self,
        q: torch.Tensor,
        kv_cache: torch.Tensor,
        sinks: torch.Tensor | None,
        kv_format: KVFormat | None,
        march: str,
    ) -> None:
        self.lib, self.format = load(march), _cache_format(kv_cache, kv_format)
        self.ok = (
            self.lib is not None
            and self.format is not None
            and q.device.type == "cpu"
            and kv_cache.is_contiguous()
        )
        if not self.ok:
            return
        assert self.format is not None
        self.q, self.kv_cache = q, kv_cache
        self.n, self.num_heads, self.head_dim = q.shape
        _, _, self.block_size, self.num_kv_heads, row = kv_cache.shape
        assert self.format.head_dim(row) == self.head_dim, f"rows of {row}, D {self.head_dim}"
        self.qf = q.to(torch.float32).contiguous()
        self.out = torch.empty(self.n, self.num_heads, self.head_dim, dtype=torch.float32)
        self.sinks = None if sinks is None else sinks.to(torch.float32).contiguous()
        assert self.sinks is None or self.sinks.shape == (self.num_heads,), "sinks: [heads]"

    def threads(self, work: int) -> int:
        """A few short rows: one thread reads their K/V faster than waking a second one (a
        sleeping OpenMP thread takes tens of microseconds to wake, per layer)."""
        return (
            1 if work * self.num_kv_heads * self.head_dim < SMALL_WORK else torch.get_num_threads()
        )

    def run(
        self, entry: str, rows: list[int], scale: float, window: int, softcap: float, work: int
    ) -> torch.Tensor | None:
        assert self.format is not None
        code = getattr(self.lib, entry)(
            self.qf.data_ptr(),
            self.kv_cache[0].data_ptr(),
            self.kv_cache[1].data_ptr(),
            self.format.kind,
            *rows,
            self.num_heads,
            self.num_kv_heads,
            self.head_dim,
            self.block_size,
            scale,
            window,
            softcap,
            None if self.sinks is None else self.sinks.data_ptr(),
            self.out.data_ptr(),
            self.threads(work),
        )
        return self.out.to(self.q.dtype) if code == 0 else None


def paged_decode(
    q: torch.Tensor,  # [n, num_heads, head_dim]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # [n, >= max blocks] int32, row i covers seq_lens[i]
    seq_lens: torch.Tensor,  # [n] int32, >= 1
    scale: float,
    window: int = 0,  # sliding window: the last `window` positions only; 0 for all
    softcap: float = 0.0,  # scores soft-capped to softcap * tanh(s / softcap); 0 for none
    sinks: torch.Tensor | None = None,  # [num_heads]: a logit per head with no value
    kv_format: KVFormat | None = None,  # a quantized cache's rows (None: kv_cache's dtype)
    march: str = "native",  # the library's instruction set (see load)
) -> torch.Tensor | None:
    """Decode attention over the paged cache, in q's dtype; None if the kernel is unavailable
    or the inputs are not CPU tensors of a supported layout (the caller falls back). The
    cache's rows are read as `kv_format` stores them (gpu_worker/kv_quant.py)."""
    call = _Call(q, kv_cache, sinks, kv_format, march)
    if not call.ok or block_tables.stride(1) != 1:
        return None
    tables = block_tables.to(torch.int32)
    lens = seq_lens.to(torch.int32).contiguous()
    read = lens.clamp(max=window) if window > 0 else lens
    rows = [tables.data_ptr(), tables.stride(0), lens.data_ptr(), call.n]
    return call.run("paged_decode", rows, scale, window, softcap, int(read.sum()))


def paged_prefill(
    q: torch.Tensor,  # [n, num_heads, head_dim]: a chunk's consecutive tokens of one sequence
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    block_table: torch.Tensor,  # [>= blocks] int32: the sequence's blocks
    num_computed: int,  # positions cached before the chunk: token i sees num_computed + i + 1
    scale: float,
    window: int = 0,
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,  # [num_heads]
    kv_format: KVFormat | None = None,
    march: str = "native",
) -> torch.Tensor | None:
    """A prefill chunk's causal attention over its sequence's paged cache (the chunk's own
    K/V already stored), each token's row the same bits as `paged_decode` gives it as a
    decode of its own length, but with each block's K/V rows read (and converted) once per
    tile of tokens instead of once per token. None when the kernel is unavailable or does not
    cover the shape (head sizes other than 64 and 128): the caller keeps the row-by-row path."""
    call = _Call(q, kv_cache, sinks, kv_format, march)
    if not call.ok or block_table.stride(0) != 1:
        return None
    n = call.n
    assert block_table.shape[0] * call.block_size >= num_computed + n, "too few blocks"
    table = block_table.to(torch.int32)
    longest = num_computed + n if window <= 0 else min(num_computed + n, window)
    rows = [table.data_ptr(), num_computed, n]
    return call.run("paged_prefill", rows, scale, window, softcap, n * longest)
