"""The `shuttle` command: `shuttle serve [MODEL] [flags]` (see `shuttle serve --help`),
`shuttle --version`."""

from __future__ import annotations

import importlib.metadata
import sys


def version() -> str:
    """The installed package's version ("0+unknown" when run from a checkout)."""
    try:
        return importlib.metadata.version("shuttle")
    except importlib.metadata.PackageNotFoundError:
        return "0+unknown"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: shuttle serve [MODEL] [flags]   (shuttle serve --help lists them)")
        return 0 if argv else 2
    if argv[0] in ("-V", "--version"):
        print(version())
        return 0
    if argv[0] == "serve":
        from services.launch import serve

        return serve(argv[1:])
    if argv[0] == "worker-ranks":  # tensor-parallel ranks on a host other than rank 0's
        from services.worker_group import worker_ranks

        return worker_ranks(argv[1:])
    if argv[0] == "prepare-model":
        from common.prepare_model import main as prepare

        return prepare(argv[1:])
    print(f"shuttle: unknown command {argv[0]!r}; try 'shuttle serve'", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
