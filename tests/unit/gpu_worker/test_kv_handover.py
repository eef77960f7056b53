"""The worker's part of the prefill/decode hand-over: blocks exported from one KV cache (to
files, or as bytes for the messages) land bit for bit in another's chosen blocks, and a block
that does not match what the decode side asked (key, tokens, model version, layout, bytes)
is refused and not written."""

from __future__ import annotations

import base64
from pathlib import Path

import torch

from common.messages import StepPlan
from gpu_worker.distributed.tensor_parallel import TensorParallel
from gpu_worker.kv_cache import KVCache
from gpu_worker.kv_handover import KVHandover


def _kv(seed: int, kv_cache_dtype: str = "auto") -> KVCache:
    kv = KVCache(num_layers=2, num_blocks=6, block_size=4, num_kv_heads=1, head_dim=8,
                 dtype=torch.float32, device=torch.device("cpu"),
                 kv_cache_dtype=kv_cache_dtype)  # fmt: skip
    kv.tensor.copy_(torch.randn(kv.tensor.shape, generator=torch.Generator().manual_seed(seed)))
    return kv


def _export(kv: KVCache, blocks: list[int], paths: list[str]) -> list[str]:
    plan = StepPlan(step_id=1, kv_export_src=blocks, kv_export_keys=[10 + b for b in blocks],
                    kv_export_tokens=[[b] * 4 for b in blocks],
                    kv_export_versions=["v1"] * len(blocks), kv_export_paths=paths)  # fmt: skip
    return KVHandover(kv, TensorParallel()).apply(plan).get("kv_export_data", [])


def _import(kv: KVCache, src: list[int], dst: list[int], paths: list[str], data: list[str],
            version: str = "v1") -> list[int]:  # fmt: skip
    plan = StepPlan(step_id=2, kv_import_dst=dst, kv_import_keys=[10 + b for b in src],
                    kv_import_tokens=[[b] * 4 for b in src],
                    kv_import_versions=[version] * len(src), kv_import_paths=paths,
                    kv_import_data=data)  # fmt: skip
    return KVHandover(kv, TensorParallel()).apply(plan)["kv_import_failed_dst"]


def test_blocks_move_through_shared_files(tmp_path: Path) -> None:
    prefill, decode = _kv(1), _kv(2)
    paths = [str(tmp_path / "h" / f"{b}.kv") for b in (3, 1)]
    assert _export(prefill, [3, 1], paths) == []  # (written to the files, no bytes answered)
    assert _import(decode, [3, 1], [0, 5], paths, []) == []
    assert torch.equal(decode.tensor[:, :, 0], prefill.tensor[:, :, 3])
    assert torch.equal(decode.tensor[:, :, 5], prefill.tensor[:, :, 1])


def test_blocks_move_as_bytes_and_int8_rows_keep_their_scales() -> None:
    prefill, decode = _kv(1, "int8"), _kv(2, "int8")
    data = _export(prefill, [2], [""])
    assert len(data) == 1 and base64.b64decode(data[0]).startswith(b"SHKV2\n")
    assert _import(decode, [2], [4], [""], data) == []
    assert torch.equal(decode.tensor[:, :, 4], prefill.tensor[:, :, 2])


def test_a_block_that_does_not_match_is_refused_and_not_written(tmp_path: Path) -> None:
    prefill, decode = _kv(1), _kv(2)
    before = decode.tensor.clone()
    paths = [str(tmp_path / "a.kv"), str(tmp_path / "b.kv")]
    _export(prefill, [0, 1], paths)
    assert _import(decode, [0, 1], [2, 3], paths, [], version="v2") == [2, 3]  # another version
    assert _import(decode, [1, 0], [2, 3], paths, []) == [2, 3]  # keys and tokens swapped
    raw = bytearray(Path(paths[0]).read_bytes())
    raw[-1] ^= 1
    Path(paths[0]).write_bytes(bytes(raw))
    assert _import(decode, [0, 1], [2, 3], paths, []) == [2]  # a flipped bit: the checksum
    assert torch.equal(decode.tensor[:, :, 2], before[:, :, 2])
    assert torch.equal(decode.tensor[:, :, 3], prefill.tensor[:, :, 1])
    other = _kv(3, "int8")  # another KV dtype's layout never reads these
    assert _import(other, [1], [0], [paths[1]], []) == [0]
    assert _import(decode, [4], [0], [str(tmp_path / "missing.kv")], []) == [0]


def test_exports_are_reported_at_once_when_asked() -> None:
    """A report (the worker's outbox) takes the exports before the step runs; the result's
    fields then carry only the imports."""
    kv, reports = _kv(1), []
    plan = StepPlan(step_id=7, kv_export_src=[2], kv_export_keys=[12], kv_export_tokens=[[2] * 4],
                    kv_export_versions=["v1"], kv_export_paths=[""])  # fmt: skip
    fields = KVHandover(kv, TensorParallel()).apply(plan, reports.append)
    (report,) = reports
    assert report.step_id == 7 and len(report.data) == 1
    assert "kv_export_data" not in fields and fields["kv_import_failed_dst"] == []
    decode = _kv(2)
    assert _import(decode, [2], [4], [""], report.data) == []
    assert torch.equal(decode.tensor[:, :, 4], kv.tensor[:, :, 2])
