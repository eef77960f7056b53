"""tools/gen-proto: regenerate the Python modules of proto/ with grpcio-tools.

    tools/gen-proto              # writes proto/shuttle/v1/shuttle_pb2{,_grpc}.py{,i}
    tools/gen-proto --out DIR    # elsewhere (the test compares the two)

Generated with `-I proto`, so the file is known as "shuttle/v1/shuttle.proto" (what
reflection shows and other languages import) and the stubs import `shuttle.v1.shuttle_pb2`;
proto/__init__.py puts proto/ on sys.path for that. The output depends on the grpcio-tools
version, which pyproject.toml pins. Never edit the generated files by hand.
"""

from __future__ import annotations

import argparse
import sys
from importlib import resources
from pathlib import Path

PROTO_ROOT = Path(__file__).resolve().parent.parent / "proto"
PROTO_FILES = ["shuttle/v1/shuttle.proto"]
GENERATED = [
    "shuttle/v1/shuttle_pb2.py",
    "shuttle/v1/shuttle_pb2.pyi",
    "shuttle/v1/shuttle_pb2_grpc.py",
]


def generate(out_dir: Path) -> list[Path]:
    """Run protoc (from grpcio-tools) on PROTO_FILES into `out_dir`; return the files written."""
    from grpc_tools import protoc

    well_known = str(resources.files("grpc_tools") / "_proto")
    out = str(out_dir)
    args = [
        "grpc_tools.protoc",
        f"-I{PROTO_ROOT}",
        f"-I{well_known}",
        f"--python_out={out}",
        f"--pyi_out={out}",
        f"--grpc_python_out={out}",
        *PROTO_FILES,
    ]
    if protoc.main(args) != 0:
        raise RuntimeError("protoc failed: " + " ".join(args))
    return [out_dir / name for name in GENERATED]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tools/gen-proto", description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=PROTO_ROOT, help="output root (default proto/)")
    args = parser.parse_args(argv)
    for path in generate(args.out):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
