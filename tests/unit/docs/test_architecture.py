"""docs/architecture.md against the code: its message table lists every registered message
kind, with its class and module, and every path it names exists."""

from __future__ import annotations

import re
from pathlib import Path

from common.codec import registry
from common.messages import Ready  # noqa: F401  (importing the package registers every kind)

REPO = Path(__file__).resolve().parents[3]
DOC = (REPO / "docs/architecture.md").read_text()
ROW = re.compile(r"^\| `(\w+)` \| `(\w+)` \| (\w+) \| (.+) \|$", re.MULTILINE)
PATH = re.compile(r"\b(?:common|services|gpu_worker|tools|tests|deploy|proto)/[\w/.-]*\w")


def _rows() -> dict[str, tuple[str, str, str]]:
    section = DOC[DOC.index("## Messages") : DOC.index("## How a request flows")]
    return {kind: (cls, module, route) for kind, cls, module, route in ROW.findall(section)}


def test_every_message_kind_is_in_the_table_with_its_class_and_module() -> None:
    rows = _rows()
    kinds = registry()
    assert sorted(rows) == sorted(kinds)
    for kind, (cls_name, module, route) in rows.items():
        cls = kinds[kind]
        assert cls.__name__ == cls_name, kind
        assert cls.__module__ == f"common.messages.{module}", kind
        assert "→" in route, kind  # who sends it to whom


def test_every_path_the_page_names_exists() -> None:
    missing = sorted({p for p in PATH.findall(DOC) if not (REPO / p).exists()})
    assert missing == []
