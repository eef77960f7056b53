"""The `shuttle` command: `shuttle serve [flags]` (see `shuttle serve --help`)."""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: shuttle serve [flags]   (shuttle serve --help lists them)")
        return 0 if argv else 2
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
