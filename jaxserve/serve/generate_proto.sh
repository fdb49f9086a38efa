#!/bin/sh
# Regenerate jaxserve_pb2.py, jaxserve_pb2.pyi and jaxserve_pb2_grpc.py from jaxserve.proto with grpcio-tools.
# The gencode pins a minimum protobuf runtime (its protoc version): keep grpcio-tools and protobuf in step.
set -eu
cd "$(dirname "$0")/../.."
"${PYTHON:-python}" -m grpc_tools.protoc -I. --python_out=. --pyi_out=. --grpc_python_out=. \
  jaxserve/serve/jaxserve.proto
