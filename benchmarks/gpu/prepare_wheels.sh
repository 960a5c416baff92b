#!/usr/bin/env bash
# Fetch, on a machine with network, the wheels a GPU host without network lacks beyond
# Python 3.12 and CUDA torch: flashinfer and the packages pagedserve needs. They land in
# .whl/ (git-ignored); copy the repository with it to the GPU host, where
# benchmarks/gpu/run.sh installs them. Where the project's .venv exists, the embedded
# default's tokenizer is also saved to .bench-tokenizer/ (git-ignored), for the structured
# output benchmarks' --tokenizer on a host that cannot fetch the model.
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PYTHON:-python3}
platform=(--only-binary=:all: --python-version 3.12 --implementation cp
  --platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
wheels=(
  flashinfer-python==0.6.18.post1 "apache-tvm-ffi>=0.1.6,<0.2,!=0.1.8,!=0.1.8.post0"
  "cuda-tile>=1.4.0" "nccl4py>=0.3.1"
  gguf==0.19.0
  grpcio==1.85.3 grpcio-health-checking==1.85.1 grpcio-reflection==1.85.1 protobuf==7.36.2
  opentelemetry-api==1.45.2 opentelemetry-sdk==1.45.2 opentelemetry-semantic-conventions==0.66b2
  opentelemetry-exporter-otlp-proto-grpc==1.45.2 opentelemetry-exporter-otlp-proto-common==1.45.2
  opentelemetry-proto==1.45.2 googleapis-common-protos==1.76.0
  pytest-asyncio llguidance==1.9.1 msgspec==0.23.0
)
mkdir -p .whl
for wheel in "${wheels[@]}"; do
  $PY -m pip download -q --no-deps "${platform[@]}" -d .whl "$wheel"
done
du -sh .whl
if [ -x .venv/bin/python ]; then
  .venv/bin/python -c "from pathlib import Path; from benchmarks.structured_output import \
save_tokenizer; from engine.model_store import resolve_model; from engine.text.tokenizer import \
Tokenizer; save_tokenizer(Tokenizer.from_path(resolve_model(None)), Path('.bench-tokenizer'))"
  echo "saved the embedded default's tokenizer to .bench-tokenizer/"
fi
