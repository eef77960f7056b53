"""The public gRPC API: proto/shuttle/v1/shuttle.proto and its generated Python modules.

protoc runs with `-I proto` (tools/gen-proto), so the file is "shuttle/v1/shuttle.proto" as
other languages see it, and the generated stubs import `shuttle.v1.shuttle_pb2`: this folder
goes on sys.path once, here, and the modules are imported under that one name only (a second
name would register the file twice in protobuf's descriptor pool).

    from proto import shuttle_pb2, shuttle_pb2_grpc
"""

import sys
from pathlib import Path

_ROOT = str(Path(__file__).resolve().parent)
if _ROOT not in sys.path:
    sys.path.append(_ROOT)

from shuttle.v1 import shuttle_pb2, shuttle_pb2_grpc  # noqa: E402

__all__ = ["shuttle_pb2", "shuttle_pb2_grpc"]
