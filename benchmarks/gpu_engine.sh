#!/usr/bin/env bash
# One device call: the offline benchmark (Llama-3-8B-shaped random bf16) with HF transformers continuous
# batching as the peer in the same run.   bash benchmarks/gpu_engine.sh   (results under $OUT)
set -uo pipefail
export PYTHONPATH=$PWD JAX_PLATFORMS=cuda PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
OUT=${OUT:-benchmarks/results}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python benchmarks/offline.py --config configs/llama3-8b-random.yaml --peer "${PEER:-transformers-cb}" \
  --out "$OUT/offline_gpu.json" 2>&1 | grep -v "it/s\]" | tail -30
