"""The committed proto/ modules are exactly what tools/gen-proto makes: nobody edits them."""

from __future__ import annotations

from pathlib import Path

from tools.gen_proto import GENERATED, PROTO_ROOT, generate


def test_generated_code_matches_a_fresh_generation(tmp_path: Path) -> None:
    written = generate(tmp_path)
    assert sorted(p.relative_to(tmp_path).as_posix() for p in written) == sorted(GENERATED)
    for name in GENERATED:
        fresh, committed = (tmp_path / name).read_bytes(), (PROTO_ROOT / name).read_bytes()
        assert fresh == committed, f"{name} differs from a fresh generation: run tools/gen-proto"


def test_generated_modules_import_under_one_name() -> None:
    from proto import shuttle_pb2, shuttle_pb2_grpc

    assert shuttle_pb2.DESCRIPTOR.name == "shuttle/v1/shuttle.proto"
    assert shuttle_pb2_grpc.shuttle_dot_v1_dot_shuttle__pb2 is shuttle_pb2
    assert set(shuttle_pb2.DESCRIPTOR.services_by_name) == {"Shuttle", "Admin"}
