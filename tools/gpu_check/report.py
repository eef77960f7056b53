"""gpu-check's report: sections of rows, errors and the time spent, and the printed table."""

from __future__ import annotations

import sys
import time
import traceback
from collections.abc import Callable
from typing import Any


class Report:
    """Sections of rows, errors, and the time spent; written as one JSON document."""

    def __init__(self, budget_s: float) -> None:
        self.start = time.monotonic()
        self.budget_s = budget_s
        self.sections: dict[str, Any] = {}
        self.section_s: dict[str, float] = {}
        self.errors: list[dict[str, str]] = []

    def run(self, name: str, fn: Callable[[], Any]) -> None:
        """Run one section; an exception fails that section only, the rest still run."""
        if time.monotonic() - self.start > self.budget_s:
            self.errors.append({"section": name, "error": "skipped: time budget spent"})
            return
        t0 = time.monotonic()
        try:
            self.sections[name] = fn()
        except Exception as e:  # a broken section must not hide the others' results
            self.errors.append({"section": name, "error": f"{type(e).__name__}: {e}",
                                "traceback": traceback.format_exc()})  # fmt: skip
        self.section_s[name] = time.monotonic() - t0
        print(f"[gpu-check] {name}: {self.section_s[name]:.1f} s", file=sys.stderr)

    def ok(self) -> bool:
        if self.errors:
            return False
        kernels = self.sections.get("kernels", [])
        return all(r["ok"] for r in kernels) and self.sections.get("parity", {}).get("ok", True)


def _table(title: str, rows: list[dict[str, Any]], columns: list[str]) -> None:
    if not rows:
        return
    print(f"\n{title}")
    cells = [[_fmt(r.get(c, "")) for c in columns] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(columns)]
    print("  ".join(c.ljust(w) for c, w in zip(columns, widths, strict=True)))
    for row in cells:
        print("  ".join(v.ljust(w) for v, w in zip(row, widths, strict=True)))


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.3g}" if abs(value) < 1e-2 else f"{value:.2f}"
    return str(value)


def print_table(doc: dict[str, Any]) -> None:
    _table(
        "kernels vs reference",
        doc.get("kernels", []),
        ["kernel", "shape", "case", "dtype", "max_abs_err", "tolerance", "ok"],
    )
    _table(
        "paged decode bandwidth",
        doc.get("decode_bandwidth", []),
        ["shape", "batch", "context", "ms", "achieved_GBps", "copy_GBps", "fraction_of_copy"],
    )
    _table(
        "extend (prefill) attention",
        doc.get("extend_speed", []),
        ["shape", "batch", "new_tokens", "ours_TFLOPs", "sdpa_TFLOPs", "ours_over_sdpa"],
    )
    _table(
        "quantized GEMMs (x @ W^T) vs dequantize-then-torch.mm and torch.mm on dense W",
        doc.get("quant_speed", []),
        ["format", "m", "n", "k", "ours_ms", "dequant_mm_ms", "mm_ms", "ours_over_dequant_mm",
         "ours_over_mm", "weight_GBps"],
    )  # fmt: skip
    _table(
        "LoRA (8 adapters) vs torch per adapter and the base layer's torch.mm",
        doc.get("lora_speed", []),
        ["tokens", "pattern", "in", "out", "rank", "ours_ms", "torch_segments_ms", "base_mm_ms",
         "ours_over_base_mm", "speedup_over_torch"],
    )  # fmt: skip
    graphs = doc.get("cuda_graphs", {})
    _table(
        f"decode step, {doc.get('model', '')} model",
        graphs.get("steps", []),
        ["batch", "context", "eager_ms", "graph_ms", "speedup"],
    )
    if "parity" in doc:
        p = doc["parity"]
        print(
            f"\ngreedy parity with transformers: {p['matching']}/{p['tokens']} tokens"
            f" (first mismatch: {p['first_mismatch']})"
        )
    for error in doc.get("errors", []):
        print(f"\nERROR in {error['section']}: {error['error']}")  # fmt: skip
