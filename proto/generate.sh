#!/usr/bin/env bash
# Regenerate the Python stubs from the contract (grpcio-tools is pinned in the test extra).
# tests/test_proto.py fails when the checked-in stubs differ from what this produces.
set -euo pipefail
cd "$(dirname "$0")"
python -m grpc_tools.protoc -I. --python_out=. --grpc_python_out=. --pyi_out=. \
    pagedserve/v1/inference.proto
