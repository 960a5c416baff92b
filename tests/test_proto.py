"""The contract: checked-in stubs equal what grpcio-tools builds from the .proto."""

from __future__ import annotations

from pathlib import Path

import pytest

PROTO_ROOT = Path(__file__).resolve().parents[1] / "proto"
CONTRACT = "pagedserve/v1/inference.proto"
STUBS = ["inference_pb2.py", "inference_pb2_grpc.py", "inference_pb2.pyi"]


def test_checked_in_stubs_match_the_contract(tmp_path):
    from grpc_tools import protoc

    args = [
        "grpc_tools.protoc",
        f"-I{PROTO_ROOT}",
        f"--python_out={tmp_path}",
        f"--grpc_python_out={tmp_path}",
        f"--pyi_out={tmp_path}",
        str(PROTO_ROOT / CONTRACT),
    ]
    assert protoc.main(args) == 0
    for name in STUBS:
        built = (tmp_path / "pagedserve" / "v1" / name).read_text()
        checked_in = (PROTO_ROOT / "pagedserve" / "v1" / name).read_text()
        assert built == checked_in, f"{name} drifted from {CONTRACT}: run proto/generate.sh"


@pytest.mark.parametrize(
    ("rpc", "server_streaming"),
    [
        ("Generate", False),
        ("StreamGenerate", True),
        ("Cancel", False),
        ("Tokenize", False),
        ("GetModelInfo", False),
    ],
)
def test_service_shape(rpc, server_streaming):
    from pagedserve.v1 import inference_pb2, inference_pb2_grpc

    service = inference_pb2.DESCRIPTOR.services_by_name["Inference"]
    method = service.methods_by_name[rpc]
    assert method.server_streaming is server_streaming
    assert not method.client_streaming
    assert hasattr(inference_pb2_grpc.InferenceStub, "__init__")
    assert hasattr(inference_pb2_grpc.InferenceServicer, rpc)


def test_zero_is_distinguishable_from_unset_where_it_matters():
    from pagedserve.v1 import inference_pb2

    request = inference_pb2.GenerateRequest(text="hi")
    assert not request.sampling.HasField("temperature")
    request.sampling.temperature = 0.0
    assert request.sampling.HasField("temperature")
    assert not request.stopping.HasField("max_tokens")
