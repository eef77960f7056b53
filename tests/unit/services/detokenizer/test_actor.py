"""The detokenizer actor: sequences keyed by (request id, index), each decoded by the
tokenizer its prompt was tokenised with, so the sequences of two models with different
vocabularies stream side by side across a hot-swap. No processes, no sockets: handlers are
called directly and what would be sent is recorded."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
from tokenizers import Tokenizer

from common.config import Config
from common.messages import (
    Abort,
    DetokNew,
    FinishReason,
    ModelChanged,
    OutputBatch,
    RequestError,
    TokenBatch,
)
from common.model_facts import tokenizer_fingerprint
from services.detokenizer.actor import DetokenizerActor, Tokenizers, load_tokenizer
from tests.tiny_models import make_own_vocab_tokenizer

NONE, STOP, LENGTH, ERROR = (
    FinishReason.NONE,
    FinishReason.STOP,
    FinishReason.LENGTH,
    FinishReason.ERROR,
)
TEXTS = [
    "The quick brown fox jumps over the lazy dog. Grüße, 你好 🎉",
    "Hello world, hello there! How are you today?",
    "Once upon a time there was a small model. Le café est très chaud.",
]


class FakeOutbox:
    def __init__(self) -> None:
        self.sent: list[Any] = []

    def send(self, msg: Any) -> None:
        self.sent.append(msg)


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """Two model folders whose tokenizers differ (other merges, other sizes)."""
    root = tmp_path_factory.mktemp("models")
    return (
        make_own_vocab_tokenizer(root / "a", vocab_size=300),
        make_own_vocab_tokenizer(root / "b", vocab_size=450),
    )


def encode(folder: Path, text: str) -> list[int]:
    return list(Tokenizer.from_file(str(folder / "tokenizer.json")).encode(text).ids)


def make_actor(folder: Path, tmp_path: Path) -> tuple[DetokenizerActor, FakeOutbox, FakeOutbox]:
    config = Config().replace(model={"model": str(folder)}, server={"run_dir": str(tmp_path)})
    actor = DetokenizerActor(config)
    # what start() sets up, with fake outboxes
    actor.tokenizers = Tokenizers(load_tokenizer(folder), tokenizer_fingerprint(folder))
    gateway, scheduler = FakeOutbox(), FakeOutbox()
    actor.gateway, actor.scheduler = gateway, scheduler  # type: ignore[assignment]  # fakes
    return actor, gateway, scheduler


def changed(folder: Path) -> ModelChanged:
    return ModelChanged(
        name="m",
        version=folder.name,
        path=str(folder),
        tokenizer_fingerprint=tokenizer_fingerprint(folder),
        max_model_len=256,
        vocab_size=450,
        eos_token_ids=[2],
    )


def new(*seqs: tuple[str, int, str], stop: list[str] | None = None) -> DetokNew:
    """Sequences of (request id, index, tokenizer fingerprint)."""
    return DetokNew(
        request_ids=[s[0] for s in seqs],
        stop=[list(stop or []) for _ in seqs],
        num_prompt_tokens=[3] * len(seqs),
        seq_indices=[s[1] for s in seqs],
        tokenizers=[s[2] for s in seqs],
    )


def texts_by_sequence(outputs: list[OutputBatch]) -> dict[tuple[str, int], str]:
    texts: dict[tuple[str, int], str] = {}
    for out in outputs:
        for rid, index, text in zip(out.request_ids, out.seq_indices, out.texts, strict=True):
            texts[rid, index] = texts.get((rid, index), "") + text
    return texts


def test_two_tokenizers_decode_side_by_side(folders: tuple[Path, Path], tmp_path: Path) -> None:
    a, b = folders
    fp_a, fp_b = tokenizer_fingerprint(a), tokenizer_fingerprint(b)
    streams = {
        ("old", 0): encode(a, TEXTS[0]),  # tokenised before the swap
        ("new", 0): encode(b, TEXTS[1]),
        ("new", 1): encode(b, TEXTS[2]),
    }
    assert encode(a, TEXTS[1]) != streams["new", 0]  # guards the test's meaning
    actor, gateway, scheduler = make_actor(a, tmp_path)
    actor._on_new(new(("old", 0, "")))  # "": the start-up tokenizer
    actor._on_model_changed(changed(b))
    actor._on_new(new(("new", 0, fp_b), ("new", 1, fp_b)))
    assert len(actor.tokenizers) == 2  # a is still used by "old"
    # one token per sequence per step, interleaved, each finishing on its last token
    for step in range(max(len(ids) for ids in streams.values())):
        live = [(key, ids) for key, ids in streams.items() if step < len(ids)]
        actor._on_tokens(
            TokenBatch(
                request_ids=[key[0] for key, _ in live],
                seq_indices=[key[1] for key, _ in live],
                token_ids=[[ids[step]] for _, ids in live],
                finish_reasons=[int(LENGTH if step == len(ids) - 1 else NONE) for _, ids in live],
                versions=["v-a" if key[0] == "old" else "v-b" for key, _ in live],
            )
        )
    assert texts_by_sequence(gateway.sent) == {
        ("old", 0): TEXTS[0],
        ("new", 0): TEXTS[1],
        ("new", 1): TEXTS[2],
    }
    assert all(len(o.seq_indices) == len(o.request_ids) for o in gateway.sent)
    assert scheduler.sent == [] and actor.streams == {}
    # a is neither current nor used: dropped; b stays (current)
    assert len(actor.tokenizers) == 1 and fp_b in actor.tokenizers and fp_a not in actor.tokenizers
    # swapping back loads a again; "" names it
    actor._on_model_changed(changed(a))
    assert "" in actor.tokenizers and fp_b not in actor.tokenizers


def test_a_stop_string_ends_one_sequence(folders: tuple[Path, Path], tmp_path: Path) -> None:
    a, _ = folders
    actor, gateway, scheduler = make_actor(a, tmp_path)
    actor._on_new(new(("r", 0, ""), ("r", 1, ""), stop=["lazy"]))
    ids_0, ids_1 = encode(a, TEXTS[1]), encode(a, TEXTS[0])  # only TEXTS[0] holds the stop
    actor._on_tokens(
        TokenBatch(
            request_ids=["r", "r"],
            seq_indices=[0, 1],
            token_ids=[ids_0, ids_1],
            finish_reasons=[0, 0],
        )
    )
    out = gateway.sent[-1]
    assert (out.request_ids, out.seq_indices) == (["r", "r"], [0, 1])
    assert out.finish_reasons == [int(NONE), int(STOP)]
    assert out.texts[1] == TEXTS[0][: TEXTS[0].index("lazy")]
    assert scheduler.sent == [Abort(request_ids=["r"], reason=int(STOP), seq_indices=[1])]
    assert list(actor.streams) == [("r", 0)]


def test_an_error_finish_forgets_and_frees_the_tokenizer(
    folders: tuple[Path, Path], tmp_path: Path
) -> None:
    a, b = folders
    actor, gateway, _ = make_actor(a, tmp_path)
    actor._on_model_changed(changed(b))
    actor._on_new(new(("r", 0, tokenizer_fingerprint(b))))
    actor._on_model_changed(changed(a))  # a swap back before the request started
    assert len(actor.tokenizers) == 2
    # the scheduler has the request tokenised again: it tells us to forget this one
    actor._on_tokens(
        TokenBatch(request_ids=["r"], seq_indices=[0], token_ids=[[]], finish_reasons=[int(ERROR)])
    )
    assert actor.streams == {} and gateway.sent == []
    assert len(actor.tokenizers) == 1 and tokenizer_fingerprint(b) not in actor.tokenizers


def test_a_sequence_no_tokenizer_can_decode_fails_its_request(
    folders: tuple[Path, Path], tmp_path: Path
) -> None:
    a, _ = folders
    actor, gateway, scheduler = make_actor(a, tmp_path)
    actor._on_model_changed(
        ModelChanged(
            name="m",
            version="x",
            path=str(tmp_path / "missing"),
            tokenizer_fingerprint="0123456789abcdef",
            max_model_len=8,
            vocab_size=8,
            eos_token_ids=[],
        )
    )
    assert actor.tokenizers.current == tokenizer_fingerprint(a)  # the failed load changed nothing
    actor._on_new(new(("r", 0, "0123456789abcdef"), ("r", 1, "0123456789abcdef")))
    assert actor.streams == {}
    [error] = gateway.sent
    assert isinstance(error, RequestError) and (error.request_id, error.status) == ("r", 500)
    assert scheduler.sent == [Abort(request_ids=["r"], reason=int(ERROR))]


def test_messages_without_indices_are_sequence_0(
    folders: tuple[Path, Path], tmp_path: Path
) -> None:
    a, _ = folders
    actor, gateway, _ = make_actor(a, tmp_path)
    actor._on_new(DetokNew(request_ids=["r"], stop=[[]], num_prompt_tokens=[3]))
    actor._on_tokens(
        TokenBatch(request_ids=["r"], token_ids=[encode(a, TEXTS[1])], finish_reasons=[int(LENGTH)])
    )
    assert texts_by_sequence(gateway.sent) == {("r", 0): TEXTS[1]}


def test_logprob_ids_get_their_texts(folders: tuple[Path, Path], tmp_path: Path) -> None:
    a, _ = folders
    actor, gateway, _ = make_actor(a, tmp_path)
    actor._on_new(new(("asks", 0, ""), ("plain", 0, "")))
    ids = encode(a, "Hello world")
    tokenizer = Tokenizer.from_file(str(a / "tokenizer.json"))
    actor._on_tokens(
        TokenBatch(
            request_ids=["asks", "plain"],
            token_ids=[ids[:2], ids[:1]],
            finish_reasons=[int(NONE), int(NONE)],
            logprob_token_ids=[[[ids[0], ids[1]], [ids[1]]], [[]]],
            logprob_values=[[[-0.1, -0.2], [-0.3]], [[]]],
            prompt_logprob_token_ids=[[[ids[2]], [ids[3], ids[0]]], []],
            prompt_logprob_values=[[[], [-1.0, -0.5]], []],
        )
    )
    (out,) = gateway.sent
    one = [tokenizer.decode([i], skip_special_tokens=False) for i in ids[:4]]
    assert out.logprob_tokens == [[[one[0], one[1]], [one[1]]], [[]]]
    assert out.logprob_values == [[[-0.1, -0.2], [-0.3]], [[]]]
    assert out.prompt_logprob_tokens == [[[one[2]], [one[3], one[0]]], []]
    assert out.prompt_logprob_token_ids == [[[ids[2]], [ids[3], ids[0]]], []]


def test_stop_strings_wait_for_min_tokens(folders: tuple[Path, Path], tmp_path: Path) -> None:
    """DetokNew's min_tokens reach each sequence's screen: "o" is inside the first tokens
    of sequence 0 (min_tokens covers them) but ends sequence 1 at once."""
    a, _ = folders
    actor, gateway, scheduler = make_actor(a, tmp_path)
    head = encode(a, "Hello world")
    ids = head + encode(a, ", then go")
    msg = new(("r", 0, ""), ("r", 1, ""), stop=["o"])
    actor._on_new(dataclasses.replace(msg, min_tokens=[len(head), 0]))
    for token in ids:
        actor._on_tokens(
            TokenBatch(
                request_ids=["r", "r"],
                token_ids=[[token], [token]],
                finish_reasons=[int(NONE), int(NONE)],
                seq_indices=[0, 1],
            )
        )
    assert texts_by_sequence(gateway.sent) == {("r", 0): "Hello world, then g", ("r", 1): "Hell"}
    aborts = [m for m in scheduler.sent if isinstance(m, Abort)]
    assert [(m.request_ids, m.seq_indices) for m in aborts] == [(["r"], [1]), (["r"], [0])]
