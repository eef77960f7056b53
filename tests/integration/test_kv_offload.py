"""The prefix cache's lower tiers on the real processes: a prompt evicted from a tiny KV pool
comes back from host memory and from disk with the same greedy tokens and cached_tokens > 0;
a restart serves it from disk; other weights and a hot swap never read the old files; a
corrupted file is discarded and the prompt recomputed."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
from transformers import AutoTokenizer

from tests.reference import hf_greedy
from tests.server import Server, running_server
from tests.tiny_models import make_tiny_model

TOKEN = "tiers-admin"
ADMIN = {"Authorization": f"Bearer {TOKEN}"}
NUM_NEW = 8
BLOCK_BYTES = 2 * 2 * 16 * 2 * 16 * 4  # layers, K/V, block size, KV heads, head dim, float32
GIB = 1 << 30
PROMPT = "A long prompt that comes back: " + " ".join(
    f"the ship number {i} sailed from the harbour at dawn;" for i in range(9)
)
OTHERS = [f"Filler {j}: " + " ".join(f"word{j}x{i} and more" for i in range(24)) for j in range(5)]


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:  # type: ignore[no-untyped-def]
    root = tmp_path_factory.mktemp("models")
    return {
        "a": make_tiny_model(root / "tiny-a", "llama", seed=1),
        "b": make_tiny_model(root / "tiny-b", "llama", seed=2),  # same layout, other weights
        "root": root,
    }


def _reference(folder: Path, prompt: str) -> str:
    tok = AutoTokenizer.from_pretrained(folder)
    return tok.decode(hf_greedy(folder, tok.encode(prompt), NUM_NEW), skip_special_tokens=True)


def _flags(model: Path, host_blocks: int, disk: Path | None, *extra: str, tp: int = 1) -> list[str]:
    block_bytes = BLOCK_BYTES // tp  # a rank's shard of a block
    flags = [
        "--model",
        str(model),
        "--dtype",
        "float32",
        "--kv-cache-memory",
        str(12 * block_bytes / GIB),  # 12 blocks of 16 tokens: a prompt of ~7 fits
        "--kv-offload-memory",
        str(host_blocks * block_bytes / GIB),
        "--tensor-parallel-size",
        str(tp),
        "--admin-token",
        TOKEN,
        *extra,
    ]
    if disk is not None:
        flags += ["--kv-offload-dir", str(disk), "--kv-offload-disk", str(256 * block_bytes / GIB)]
    return flags


def _complete(server: Server, prompt: str) -> tuple[str, int]:
    r = httpx.post(
        server.url + "/v1/completions",
        timeout=120,
        json={
            "model": server.model,
            "prompt": prompt,
            "max_tokens": NUM_NEW,
            "temperature": 0.0,
            "ignore_eos": True,
        },
    )
    assert r.status_code == 200, r.text
    body = r.json()
    details = body["usage"].get("prompt_tokens_details") or {}
    return body["choices"][0]["text"], int(details.get("cached_tokens") or 0)


def _stats(server: Server) -> dict:
    return httpx.get(server.url + "/admin/stats", headers=ADMIN, timeout=30).json()


def _evict(server: Server) -> None:
    """Other prompts, enough to push PROMPT's blocks out of the pool (and host memory)."""
    for other in OTHERS:
        _complete(server, other)


def test_a_prompt_evicted_from_the_pool_comes_back_from_host_memory(
    models: dict[str, Path],
) -> None:
    want = _reference(models["a"], PROMPT)
    with running_server(*_flags(models["a"], host_blocks=64, disk=None)) as server:
        assert _complete(server, PROMPT) == (want, 0)
        _evict(server)
        text, cached = _complete(server, PROMPT)
        stats = _stats(server)
        assert text == want
        assert cached >= 64 and stats["kv_offload_host_hits"] * 16 >= cached - 16
        assert stats["kv_offload_disk_blocks"] == 0
        assert stats["kv_offload_host_blocks"] > 0
        assert stats["kv_offload_host_bytes"] == stats["kv_offload_host_blocks"] * BLOCK_BYTES
        metrics = httpx.get(server.url + "/metrics", timeout=30).text
        assert "shuttle:kv_offload_host_hits_total" in metrics


def test_disk_tier_serves_after_eviction_and_after_a_restart(
    models: dict[str, Path], tmp_path: Path
) -> None:
    want = _reference(models["a"], PROMPT)
    disk = tmp_path / "kv"
    flags = _flags(models["a"], host_blocks=8, disk=disk)
    with running_server(*flags) as server:
        assert _complete(server, PROMPT) == (want, 0)
        _evict(server)
        assert _stats(server)["kv_offload_disk_blocks"] > 0
        text, cached = _complete(server, PROMPT)
        stats = _stats(server)
        assert text == want and cached >= 64
        assert stats["kv_offload_disk_hits"] > 0 and stats["kv_offload_fetch_failures"] == 0
    files = list(disk.glob("worker/rank0of1/*.kv"))
    assert files  # they outlive the server
    with running_server(*flags) as server:  # the same model, weights and dtype: from disk
        assert _stats(server)["kv_offload_disk_blocks"] == len(files)
        text, cached = _complete(server, PROMPT)
        assert text == want and cached >= 64
        assert _stats(server)["kv_offload_disk_hits"] > 0


def test_other_weights_and_corrupted_files_are_never_served(
    models: dict[str, Path], tmp_path: Path
) -> None:
    disk = tmp_path / "kv"
    want_a, want_b = _reference(models["a"], PROMPT), _reference(models["b"], PROMPT)
    with running_server(*_flags(models["a"], host_blocks=8, disk=disk)) as server:
        _complete(server, PROMPT)
        _evict(server)
    files = sorted(disk.glob("worker/rank0of1/*.kv"))
    assert files
    # corrupt every file's last byte: each read fails its checksum and is discarded
    for path in files:
        data = bytearray(path.read_bytes())
        data[-1] ^= 0x55
        path.write_bytes(bytes(data))
    with running_server(*_flags(models["a"], host_blocks=8, disk=disk)) as server:
        text, cached = _complete(server, PROMPT)
        stats = _stats(server)
        assert text == want_a and cached == 0
        assert stats["kv_offload_fetch_failures"] > 0 and stats["kv_offload_disk_hits"] == 0
        _evict(server)  # written again, sound this time
    assert list(disk.glob("worker/rank0of1/*.kv"))
    # other weights in the same folder: the files are not theirs (deleted at start-up)
    with running_server(*_flags(models["b"], host_blocks=8, disk=disk)) as server:
        assert _stats(server)["kv_offload_disk_blocks"] == 0
        text, cached = _complete(server, PROMPT)
        assert text == want_b and cached == 0


def test_a_hot_swap_never_reads_the_old_versions_blocks(
    models: dict[str, Path], tmp_path: Path
) -> None:
    disk = tmp_path / "kv"
    flags = _flags(models["a"], 8, disk, "--model-root", str(models["root"]))
    with running_server(*flags) as server:
        _complete(server, PROMPT)
        _evict(server)
        before = _stats(server)
        assert before["kv_offload_disk_blocks"] > 0
        r = httpx.post(
            server.url + "/admin/swap-model",
            json={"model": str(models["b"]), "mode": "overlap", "version": "b"},
            headers=ADMIN,
            timeout=120,
        )
        assert r.status_code == 200, r.text
        text, cached = _complete(server, PROMPT)
        after = _stats(server)
        assert text == _reference(models["b"], PROMPT) and cached == 0
        assert after["kv_offload_disk_hits"] == before["kv_offload_disk_hits"]
        assert after["kv_offload_host_hits"] == before["kv_offload_host_hits"]


def test_tp2_each_rank_keeps_its_shard_and_a_bad_shard_fails_the_read_everywhere(
    models: dict[str, Path], tmp_path: Path
) -> None:
    want = _reference(models["a"], PROMPT)
    disk = tmp_path / "kv"
    flags = _flags(models["a"], host_blocks=8, disk=disk, tp=2)
    with running_server(*flags) as server:
        assert _complete(server, PROMPT) == (want, 0)
        _evict(server)
        text, cached = _complete(server, PROMPT)
        assert text == want and cached >= 64
        assert _stats(server)["kv_offload_disk_hits"] > 0
    ranks = [sorted(p.name for p in disk.glob(f"worker/rank{r}of2/*.kv")) for r in (0, 1)]
    assert ranks[0] and ranks[0] == ranks[1]  # the same blocks, one shard each
    with running_server(*flags) as server:  # a restart: from both ranks' files
        text, cached = _complete(server, PROMPT)
        assert text == want and cached >= 64
    for path in disk.glob("worker/rank1of2/*.kv"):  # rank 1's shards only
        data = bytearray(path.read_bytes())
        data[-1] ^= 0x55
        path.write_bytes(bytes(data))
    with running_server(*flags) as server:
        text, cached = _complete(server, PROMPT)
        stats = _stats(server)
        assert text == want and cached == 0
        assert stats["kv_offload_fetch_failures"] > 0 and stats["kv_offload_disk_hits"] == 0
