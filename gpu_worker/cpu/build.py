"""Build a C source into a shared library once per machine, and load it.

The library goes to `<cache>/kernels/` (`$SHUTTLE_CACHE_DIR`, else ~/.cache/shuttle), named by
a hash of the source, the flags and this CPU's feature flags, so a rebuilt image or another
CPU never loads a stale binary. Built aside and renamed, so concurrent processes never load
half a file. The libraries use torch's OpenMP runtime (the process's libgomp: same soname).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path

from common.cpu_features import cpu_flags

log = logging.getLogger(__name__)

# -ffast-math for reassociated sums; infinities stay meaningful (-fno-finite-math-only, which
# also turns off -ffast-math's use of glibc's vector expf: VECTOR_MATH declares it again)
FLAGS = [
    "-O3",
    "-march=native",
    "-ffast-math",
    "-fno-finite-math-only",
    "-fopenmp",
    "-shared",
    "-fPIC",
]
# glibc's libmvec (x86-64 Linux): `expf` in `omp simd` loops becomes its 8/16-lane version
# (~1.7x faster measured, within 2e-7 relative, infinities kept) when the source sees
# SHUTTLE_LIBMVEC
VECTOR_MATH = ["-DSHUTTLE_LIBMVEC", "-lmvec"]


def build_flags(march: str = "native") -> list[str]:
    """FLAGS, with VECTOR_MATH where this machine has libmvec; `march` for another
    instruction set than this CPU's (tests build an AVX2-only library with "haswell")."""
    has_mvec = platform.machine() == "x86_64" and ctypes.util.find_library("mvec") is not None
    flags = [f"-march={march}" if f == "-march=native" else f for f in FLAGS]
    return flags + VECTOR_MATH if has_mvec else flags


def library_path(source: Path, includes: tuple[Path, ...] = (), march: str = "native") -> Path:
    """Where `source`'s library goes: named by the source, the files it #includes, the
    flags and this CPU's features."""
    from common.prepare_model import cache_root

    flags = " ".join(build_flags(march)) + " ".join(sorted(cpu_flags()))
    text = b"".join(p.read_bytes() for p in (source, *includes))
    key = hashlib.sha256(text + flags.encode()).hexdigest()[:16]
    return cache_root() / "kernels" / f"{source.stem}-{key}.so"


def _build(source: Path, target: Path, march: str = "native") -> None:
    compiler = os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")
    if compiler is None:
        raise RuntimeError("no C compiler (gcc) on PATH")
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        subprocess.run(
            [compiler, *build_flags(march), str(source), "-o", tmp, "-lm"],
            check=True,
            capture_output=True,
            text=True,
            timeout=120,
        )
        os.replace(tmp, target)
    except subprocess.CalledProcessError as e:
        raise RuntimeError(f"building {source.name} failed: {e.stderr[-2000:]}") from None
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def load_library(
    source: Path, includes: tuple[Path, ...] = (), march: str = "native"
) -> ctypes.CDLL:
    """The library of `source` (which #includes `includes`), built first if this machine has
    none. Raises OSError, RuntimeError or SubprocessError when it cannot be built or loaded."""
    path = library_path(source, includes, march)
    if not path.is_file():
        _build(source, path, march)
    return ctypes.CDLL(str(path))


class KernelLibrary:
    """One C source's library, built and loaded on first use, once per process; `declare`
    sets its functions' ctypes signatures; `includes` are the sources it #includes (their
    text goes into the library's name too); `march` the instruction set it is built for.
    `load()` is None, after one logged warning, when it cannot be had: callers keep their
    torch path."""

    def __init__(
        self,
        source: Path,
        declare: Callable[[ctypes.CDLL], None],
        what: str,
        includes: tuple[Path, ...] = (),
        march: str = "native",
    ) -> None:
        self.source, self.declare, self.what, self.includes = source, declare, what, includes
        self.march = march
        self._lock = threading.Lock()
        self._lib: ctypes.CDLL | None = None
        self._failed = False

    def load(self) -> ctypes.CDLL | None:
        if self._lib is not None:
            return self._lib
        with self._lock:
            if self._lib is None and not self._failed:
                try:
                    lib = load_library(self.source, self.includes, self.march)
                    self.declare(lib)
                    self._lib = lib
                except (OSError, RuntimeError, subprocess.SubprocessError) as e:
                    self._failed = True
                    log.warning("%s unavailable, using torch: %s", self.what, e)
        return self._lib
