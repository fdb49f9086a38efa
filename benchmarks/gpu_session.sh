#!/usr/bin/env bash
# Everything the open GPU items need, in one device call (~8 min on one H100): the offline benchmark with its
# HF peer (async scheduling, the denser ladder), the gRPC load benchmark, and the attention sweep with every
# peer and the CUDA custom call in the same run. Results land under $OUT; copy them to benchmarks/results/.
#   run: JAXSERVE_COMMIT=<sha> bash benchmarks/gpu_session.sh
set -uo pipefail
export PYTHONPATH=$PWD JAX_PLATFORMS=cuda PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
OUT=${OUT:-benchmarks/results}
CONFIG=configs/llama3-8b-random.yaml
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
timeout 300 python benchmarks/offline.py --config $CONFIG --peer transformers-cb --out "$OUT/offline_gpu.json" \
  2>&1 | grep -v "it/s\]" | tail -5
timeout 240 python benchmarks/serve_load.py --config $CONFIG --num-prompts 512 --input-len 512 --output-len 128 \
  --max-concurrency 256 --request-rate 16 inf --out "$OUT/serve_gpu.json" 2>&1 | grep -v "it/s\]" | tail -8
timeout 200 python benchmarks/attention.py --out "$OUT/attention_h100.json" 2>&1 | tail -25
