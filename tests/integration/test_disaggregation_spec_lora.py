"""Speculative decoding and LoRA through the prefill -> decode hand-over, on the real
processes (--prefill-replicas 1 --decode-replicas 1, shared memory): greedy parity with
transformers with --speculative ngram (the decode replica drafts from the prompt and the
output it received) and with a draft model (whose KV of the moved blocks the decode replica
computes again from the tokens); an adapter's requests (a start-up one, and one loaded and
unloaded over the admin API, which reaches both replicas) equal transformers + peft, their
blocks moved under the adapter's root.

Tiny random models, two servers: ~2 min on 2 cores."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
from transformers import AutoTokenizer

from tests.integration.test_disaggregation import ADMIN, PD, _by_role, _check_parity, _idle, _stats
from tests.integration.test_parity_serving import NUM_NEW, TEXTS, _complete
from tests.lora_adapters import make_adapter, peft_model
from tests.reference import greedy
from tests.server import Server, running_server
from tests.tiny_models import make_tiny_model
from tests.waiting import wait_until


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("pd-spec-lora")
    model = make_tiny_model(root / "tiny", "llama", seed=1)
    return {
        "model": model,
        "draft": make_tiny_model(root / "draft", "llama", seed=3),  # (the same vocabulary)
        "a0": make_adapter(model, root / "a0", r=4, seed=11),
        "a1": make_adapter(model, root / "a1", r=8, seed=12, target_modules="all-linear"),
    }


@pytest.fixture(scope="module")
def ngram_lora(folders: dict[str, Path]):  # type: ignore[no-untyped-def]
    flags = ("--speculative", "ngram", "--enable-lora", "--lora-modules", f"a0={folders['a0']}")
    with running_server(*PD, *flags, "--model", str(folders["model"])) as s:
        yield s


def _spec_on_decode(server: Server) -> dict:
    decode = _by_role(server)["decode"]
    assert decode["spec_num_drafts"] > 0 and decode["spec_num_draft_tokens"] > 0
    return decode


def test_ngram_parity_through_the_hand_over(ngram_lora: Server, folders: dict) -> None:
    _check_parity(ngram_lora, folders["model"])
    _spec_on_decode(ngram_lora)  # the decode replica drafted (and verified) the tokens


def _adapter_parity(server: Server, folders: dict, name: str) -> None:
    """Every prompt with adapter `name`: transformers + peft's greedy tokens, its blocks
    moved to the decode replica (none refused on arrival)."""
    tok = AutoTokenizer.from_pretrained(folders["model"])
    prompts = [tok.encode(t) for t in TEXTS[::2]]
    reference = peft_model(str(folders["model"]), str(folders[name]))
    expected = [greedy(reference, p, NUM_NEW) for p in prompts]
    before = _by_role(server)["decode"]
    with server.client(timeout=900) as client:
        assert [_complete(client, name, p) for p in prompts] == expected
    after = _by_role(server)["decode"]
    assert after["kv_handover_num_received"] >= before["kv_handover_num_received"] + len(prompts)
    assert after["kv_handover_blocks_received"] > before["kv_handover_blocks_received"]
    assert after["kv_handover_num_refused"] == before["kv_handover_num_refused"]
    assert after["lora_adapters"][name]["num_cached_blocks"] > 0  # under the adapter's root
    wait_until(lambda: _idle(server), 60, "both replicas idle, every block free")


def test_a_lora_request_is_prefilled_and_decoded_with_its_adapter(
    ngram_lora: Server, folders: dict
) -> None:
    _adapter_parity(ngram_lora, folders, "a0")


def test_an_adapter_loaded_over_the_admin_api_reaches_both_roles(
    ngram_lora: Server, folders: dict
) -> None:
    body = {"lora_name": "a1", "lora_path": str(folders["a1"])}
    url = ngram_lora.url
    r = httpx.post(url + "/v1/load_lora_adapter", json=body, headers=ADMIN, timeout=300)
    assert r.status_code == 200, r.text
    assert all("a1" in r["lora_adapters"] for r in _stats(ngram_lora)["replicas"])
    _adapter_parity(ngram_lora, folders, "a1")
    body = {"lora_name": "a1"}
    r = httpx.post(url + "/v1/unload_lora_adapter", json=body, headers=ADMIN, timeout=300)
    assert r.status_code == 200, r.text
    assert all("a1" not in r["lora_adapters"] for r in _stats(ngram_lora)["replicas"])


def test_draft_model_parity_through_the_hand_over(folders: dict) -> None:
    flags = ("--speculative", "draft", "--draft-model", str(folders["draft"]))
    with running_server(*PD, *flags, "--model", str(folders["model"])) as s:
        _check_parity(s, folders["model"])
        _spec_on_decode(s)
