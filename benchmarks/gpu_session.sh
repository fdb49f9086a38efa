#!/usr/bin/env bash
# The H100 runs behind the committed GPU results, as device calls of under 10 minutes each (time limits sum
# to at most 540 s per part). Results and a log land under $OUT; copy them to benchmarks/results/.
#   JAXSERVE_COMMIT=<sha> bash benchmarks/gpu_session.sh engine      # offline + HF peer
#   JAXSERVE_COMMIT=<sha> bash benchmarks/gpu_session.sh attention   # the kernel sweep with every peer
#   JAXSERVE_COMMIT=<sha> bash benchmarks/gpu_session.sh serve       # gRPC load benchmark at two request rates
#   JAXSERVE_COMMIT=<sha> bash benchmarks/gpu_session.sh tests       # the GPU-relevant tests, compiled on the GPU
#   JAXSERVE_COMMIT=<sha> bash benchmarks/gpu_session.sh sweep       # the bucket sweep's decode rows
set -uo pipefail
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} JAX_PLATFORMS=cuda PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
OUT=${OUT:-benchmarks/results}
CONFIG=configs/llama3-8b-random.yaml
LOG=$OUT/gpu_session_${1:?engine, attention, serve, tests or sweep}.log
run() {  # run LIMIT_S CMD...: one benchmark, its output (progress bars dropped) appended to the log
    local limit=$1; shift
    echo "\$ $*" | tee -a "$LOG"
    timeout "$limit" "$@" 2>&1 | tr '\r' '\n' | grep --line-buffered -v -e "it/s\]" -e "s/it\]" | tee -a "$LOG"
    echo "rc=${PIPESTATUS[0]}" | tee -a "$LOG"
}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$LOG"
case $1 in
  engine)
    run 540 python benchmarks/offline.py --config $CONFIG --peer transformers-cb --out "$OUT/offline_gpu.json" ;;
  attention)
    run 540 python benchmarks/attention.py --out "$OUT/attention_h100.json" ;;
  tests)   # tests that use the smollm fixtures need the embedded model's package, which the GPU image lacks
    run 540 python -m pytest -q -p no:cacheprovider tests/test_kv_cache.py tests/test_custom_calls.py \
      tests/test_ragged_paged_attention.py tests/test_engine.py \
      -k "not test_batched_greedy and not prefix_caching_on_and_off and not stream_yields" ;;
  sweep)
    run 540 python benchmarks/sweep.py --config $CONFIG --token-buckets 256 1024 4096 --seq-buckets 64 256 \
      --contexts 512 2048 --kinds decode --warmup 2 --repeats 5 --out "$OUT/sweep_gpu_decode.json" ;;
  serve)
    run 540 python benchmarks/serve_load.py --config $CONFIG --num-prompts 512 --input-len 512 --output-len 128 \
      --max-concurrency 256 --request-rate 16 inf --out "$OUT/serve_gpu.json" ;;
esac
