"""Structured outputs in the engine that ships (in-process: real policy, real runner, real
model): greedy free requests keep transformers' tokens when constrained requests share their
batches, and constrained sequences (n > 1, each with its own matcher) stay valid through
preemption by recompute and by swap, with and without overlapped scheduling; speculative
decoding leaves them undrafted; after a hot-swap to another tokenizer, each version's
requests use grammars compiled for its own tokenizer."""

from __future__ import annotations

import json

import jsonschema
import pytest
from transformers import AutoTokenizer

from common.messages import SamplingParams
from gpu_worker.runner.model_runner import ModelRunner
from gpu_worker.runner.options import RunnerOptions
from services.scheduler.intake import sequence_key
from tests.integration.test_scheduler_parity import _engine, _reference

NUM_NEW = 24
FREE = ["The capital of France is", "def fibonacci(n):\n    ", "List three primary colours:\n1."]
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["red", "blue"]}, "maxItems": 3},
    },
    "required": ["name", "age", "tags"],
    "additionalProperties": False,
}
CONSTRAINED = SamplingParams(
    max_tokens=60,
    temperature=1.0,
    seed=5,
    n=2,
    structured_kind="json",
    structured_spec=json.dumps(SCHEMA),
    structured_field="guided_json",
)
GREEDY = SamplingParams(max_tokens=NUM_NEW, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir() -> str:
    from common.prepare_model import prepare_default_model

    return str(prepare_default_model())


@pytest.fixture(scope="module")
def runner(model_dir: str) -> ModelRunner:
    options = RunnerOptions(
        block_size=16, kv_cache_memory_gib=0.25, num_threads=2, swap_space_gib=0.25
    )
    return ModelRunner(model_dir, options)


@pytest.fixture(scope="module")
def tok(model_dir: str):  # type: ignore[no-untyped-def]
    return AutoTokenizer.from_pretrained(model_dir)


def _json_prompt(tok, i: int) -> list[int]:  # type: ignore[no-untyped-def]
    text = tok.apply_chat_template(
        [{"role": "user", "content": f"Person number {i} as JSON, please."}],
        add_generation_prompt=True,
        tokenize=False,
    )
    return list(tok.encode(text))


def _serve_mixed(engine, tok):  # type: ignore[no-untyped-def]
    """Free greedy requests and constrained ones interleaved, all queued at once: their
    outputs, and the constrained sequences' ids."""
    free_ids, constrained_ids = [], []
    for i, text in enumerate(FREE):
        free_ids.append(engine.add(tok.encode(text), GREEDY)[0])
        constrained_ids += engine.add(_json_prompt(tok, i), CONSTRAINED)
    out = engine.run()
    return [out[s] for s in free_ids], [out[s] for s in constrained_ids], constrained_ids


def _check_constrained(tok, outputs: list[list[int]]) -> None:  # type: ignore[no-untyped-def]
    eos = set(tok.all_special_ids)
    for tokens in outputs:
        assert tokens and tokens[-1] in eos, tok.decode(tokens)  # the grammar ended it
        jsonschema.validate(json.loads(tok.decode(tokens[:-1])), SCHEMA)


@pytest.mark.parametrize("overlap", [True, False])
def test_free_greedy_outputs_unchanged_beside_constrained(runner, tok, overlap: bool) -> None:
    engine = _engine(runner, overlap=overlap)
    free, constrained, _ = _serve_mixed(engine, tok)
    expected = [_reference(runner.model_path, tuple(tok.encode(t)))[:NUM_NEW] for t in FREE]
    assert free == expected
    _check_constrained(tok, constrained)
    assert len(constrained) == len(FREE) * CONSTRAINED.n


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_constrained_sequences_survive_preemption(runner, tok, mode: str) -> None:
    # 12 blocks of 16 tokens for 9 sequences of ~40-90 tokens: they cannot all fit
    engine = _engine(
        runner,
        num_blocks=12,
        num_host_blocks=60,
        preemption_mode=mode,
        watermark=0.0,
        prefix_caching=False,
    )
    free, constrained, _ = _serve_mixed(engine, tok)
    assert engine.policy.num_preemptions > 0
    expected = [_reference(runner.model_path, tuple(tok.encode(t)))[:NUM_NEW] for t in FREE]
    assert free == expected
    _check_constrained(tok, constrained)


def test_speculative_decoding_leaves_constrained_rows_undrafted(model_dir: str, tok) -> None:
    """Drafts are not checked against a grammar, so a constrained sequence gets no draft
    slots (the policy gives none; the worker refuses a plan that does): it decodes one token
    a step beside speculating free rows, and its output stays valid."""
    from services.scheduler.policy import PolicyConfig
    from tests.engine import LocalEngine

    spec = ModelRunner(
        model_dir,
        RunnerOptions(
            block_size=16,
            kv_cache_memory_gib=0.25,
            num_threads=2,
            speculative="ngram",
            prompt_lookup_min=1,
            prompt_lookup_max=3,
        ),
    )
    engine = LocalEngine(spec, PolicyConfig(num_speculative_tokens=3), overlap=False)
    free, constrained, ids = _serve_mixed(engine, tok)
    expected = [_reference(model_dir, tuple(tok.encode(t)))[:NUM_NEW] for t in FREE]
    assert free == expected
    _check_constrained(tok, constrained)
    proposed: dict[str, int] = {}
    for result in engine.results:
        for key, n in zip(result.req_ids, result.num_proposed, strict=False):
            proposed[key] = proposed.get(key, 0) + n
    assert all(proposed.get(sequence_key(rid, i), 0) == 0 for rid, i in ids)
    assert sum(proposed.values()) > 0  # while the free rows were drafted for


def test_a_grammar_belongs_to_the_tokenizer_of_the_version_serving_it(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """Hot-swap to a model with another tokenizer: requests on each version are constrained
    by a grammar compiled for that version's own tokenizer (the same choices are other
    token ids there)."""
    from services.scheduler.policy import PolicyConfig
    from tests.engine import LocalEngine
    from tests.tiny_models import make_tiny_model, make_tiny_model_own_vocab

    root = tmp_path_factory.mktemp("models")
    smol_vocab = make_tiny_model(root / "smol-vocab", seed=1)
    own_vocab = make_tiny_model_own_vocab(root / "own-vocab", seed=2)
    runner = ModelRunner(
        str(smol_vocab), RunnerOptions(block_size=16, num_blocks=64, num_threads=2)
    )
    engine = LocalEngine(runner, PolicyConfig())
    choices = ["the quick brown fox", "hello world"]
    sampling = SamplingParams(
        max_tokens=30,
        temperature=1.0,
        seed=3,
        n=2,
        structured_kind="choice",
        structured_spec=json.dumps(choices),
    )
    outputs = {}
    for folder in (smol_vocab, own_vocab):
        if folder == own_vocab:  # the swap: new requests start on the new version
            runner.set_default_version(runner.load_version(str(own_vocab)))
            engine.core.adopt(runner.model_info())
        tok = AutoTokenizer.from_pretrained(folder)
        ids = engine.add(tok.encode("Say something:"), sampling)
        out = engine.run()
        outputs[folder.name] = [tok.decode(out[s], skip_special_tokens=True) for s in ids]
    for texts in outputs.values():
        assert all(text in choices for text in texts), outputs
    assert runner.grammars.num_tokenizers == 2  # one compiler per tokenizer
