#!/usr/bin/env bash
# Regenerates proxy/pb/ from proto/*.proto (Python modules and .pyi stubs).
# Usage: bash scripts/gen_proto.sh [OUTDIR]   (default: proxy/pb)
# Needs grpcio-tools (a dev dependency, pinned in pyproject.toml).
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
out=${1:-$here/proxy/pb}
mkdir -p "$out"
python=${PYTHON:-python}
"$python" -m grpc_tools.protoc -I"$here/proto" --python_out="$out" \
    PulsarApi.proto PulsarMarkers.proto $(cd "$here/proto" && ls | grep -v -e '^PulsarApi.proto$' -e '^PulsarMarkers.proto$' | grep '\.proto$' || true)
