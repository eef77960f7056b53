"""Every repository path a comment, docstring or document cites exists, and nothing cites a
document outside the repository (docs/architecture.md is the project's design).

A cited path is a token like `gpu_worker/cpu/gguf.c`, `models/llama.py` or `http/` in any
tracked source or document:

    gpu_worker/cpu/gguf.c   starts at a top-level entry of the repository: it must exist there
    cpu/gguf.c, http/       relative: it must exist below the citing file's folder or a folder
                            above it, or end some tracked path; when it does neither and its
                            first folder is a folder of the repository (`models/`), it names a
                            file that moved or is gone
    gguf.c                  a bare C file name (in C sources and documents): some tracked file

Tokens with placeholders (`<name>`, `*`, `{a,b}`, `$VAR`), absolute paths and URLs name no
file of the repository and are not checked; nor are relative paths outside the repository's
folders (an example output `out/peers.json`, another project's `gguf/quants.py`)."""

from __future__ import annotations

import re
import subprocess
from functools import cache
from pathlib import Path, PurePosixPath

REPO = Path(__file__).resolve().parents[3]
SOURCE_SUFFIXES = {".py", ".c", ".h", ".md", ".proto", ".sh", ".toml", ".yaml", ".yml", ".cfg"}
SOURCE_NAMES = {"Makefile", "Dockerfile", "run"}
CITED_SUFFIXES = r"py|c|h|md|proto|sh|toml|yaml|yml|json|txt|html|js|css|png|svg"
# a path with at least one folder (`a/b.py`, `a/b/`), or a bare source file name (`gguf.c`)
PATH = re.compile(
    rf"(?<![\w./$<>*{{~-])((?:\.\./)*(?:[A-Za-z_][\w.-]*/)+(?:[\w.-]+\.(?:{CITED_SUFFIXES})\b)?"
    rf"|[A-Za-z_][\w-]*\.(?:py|c|h)\b)(?![\w*<>{{$/-]|\.\w)"
)
# what a token may be that is not a repository path: prose and API names with a slash
NOT_PATHS = re.compile(r"^(https?:|www\.|[\w.-]+\.(com|org|io|net)/|/)")
SELF = PurePosixPath("tests/unit/docs/test_citations.py")
OUTSIDE = re.compile(r"DESIGN(\.md)? ?§|\.\./shared/|shared/(DESIGN|CONVENTIONS|PERF-NOTES)")


@cache
def tracked() -> tuple[PurePosixPath, ...]:
    out = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True)
    return tuple(PurePosixPath(line) for line in out.stdout.splitlines())


@cache
def tracked_names() -> frozenset[str]:
    return frozenset(p.name for p in tracked())


@cache
def tracked_dirs() -> frozenset[PurePosixPath]:
    return frozenset(parent for p in tracked() for parent in p.parents)


def _sources() -> list[PurePosixPath]:
    return [
        p
        for p in tracked()
        if (p.suffix in SOURCE_SUFFIXES or p.name in SOURCE_NAMES)
        and not str(p).startswith("docs/bench/")
        and not p.name.endswith(("_pb2.py", "_pb2_grpc.py", "_pb2.pyi"))
        and p != SELF  # (its own examples name no file)
    ]


def _exists(cited: str, where: PurePosixPath) -> bool:
    target = _normal(PurePosixPath(cited.rstrip("/")))
    known = tracked_dirs() if cited.endswith("/") else frozenset(tracked())
    if "/" not in cited:
        return where.suffix not in (".c", ".h", ".md") or cited in tracked_names()
    if cited.startswith("../"):
        return _normal(where.parent / cited.rstrip("/")) in known
    if target.parts[0] in top_level():
        return target in known
    if any(_normal(d / target) in known for d in where.parents):
        return True
    if any(str(k).endswith("/" + str(target)) for k in known):
        return True
    return target.parts[0] not in {d.name for d in tracked_dirs()}


@cache
def top_level() -> frozenset[str]:
    return frozenset(p.parts[0] for p in tracked())


def _normal(p: PurePosixPath) -> PurePosixPath:
    parts: list[str] = []
    for part in p.parts:
        if part == "..":
            if not parts:
                return PurePosixPath("/outside")
            parts.pop()
        elif part != ".":
            parts.append(part)
    return PurePosixPath(*parts) if parts else PurePosixPath(".")


def cited_paths(text: str) -> list[tuple[int, str]]:
    """(line number, token) of every path-like token in `text`."""
    found = []
    for number, line in enumerate(text.splitlines(), 1):
        for m in PATH.finditer(line):
            token = m.group(1)
            if NOT_PATHS.match(token) or token.count("/") == 0 and "." not in token:
                continue
            found.append((number, token))
    return found


def test_every_cited_path_exists() -> None:
    missing = []
    for path in _sources():
        text = (REPO / path).read_text(errors="replace")
        for number, token in cited_paths(text):
            if not _exists(token, path):
                missing.append(f"{path}:{number}: {token}")
    assert missing == []


def test_nothing_cites_a_document_outside_the_repository() -> None:
    outside = [
        f"{path}:{number}"
        for path in _sources()
        for number, line in enumerate((REPO / path).read_text().splitlines(), 1)
        if OUTSIDE.search(line)
    ]
    assert outside == []


def test_the_checker_finds_paths() -> None:
    text = "see gpu_worker/cpu/gguf.c and cpu/ and `models/llama.py's` and gguf.c, not x/y.com/z"
    assert [t for _, t in cited_paths(text)] == [
        "gpu_worker/cpu/gguf.c",
        "cpu/",
        "models/llama.py",
        "gguf.c",
    ]
    assert _exists("cpu/gguf.c", PurePosixPath("gpu_worker/attention/x.py"))
    assert _exists("http/sse.py", PurePosixPath("docs/architecture.md"))
    assert _exists("out/peers.json", PurePosixPath("tools/bench.py"))  # not the repository's
    assert not _exists("gpu_worker/nothing_here.py", PurePosixPath("README.md"))
    assert not _exists("models/nothing_here.py", PurePosixPath("gpu_worker/x.py"))
    assert not _exists("nothing_here.c", PurePosixPath("gpu_worker/cpu/gguf.c"))
