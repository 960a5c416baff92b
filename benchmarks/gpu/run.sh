#!/usr/bin/env bash
# The GPU tests and benchmarks on one CUDA host (Python 3.12 with CUDA torch installed;
# it needs no network): run benchmarks/gpu/prepare_wheels.sh on a machine with network
# first, copy the repository with its .whl/ to the GPU host and run, from the repository
# root,
#
#   bash benchmarks/gpu/run.sh tests bench        # or: make bench-gpu
#
# The wheels are installed into /tmp/site; every step appends to $OUT/log.txt (default
# OUT=/tmp/out) and writes its JSON result beside it.
#
# Steps (arguments, in any order):
#   tests               the GPU tests (pytest -m gpu)
#   bench               gpu_bench.py: nano-vllm's workload against its roofline, batch-1 latency
#   bench-base          the same benchmark on each engine benchmarks/gpu/ab_base.sh staged
#   bench-hf            bench, plus transformers on the same workload
#   bench-32k           bench with 32,768-token steps
#   bench-sync          bench with async scheduling off
#   smollm2             bench on the SmolLM2-135M shape
#   bench-moe           bench on the Qwen3-30B-A3B shape (128 experts, 8 per token)
#   bench-gemma3        bench on the Gemma-3-12B shape (sliding-window layers, head_dim 256)
#   bench-fp8-kv        bench with a bf16 KV cache, then an fp8 one (Qwen3-0.6B shape)
#   bench-fp8-8b        bench on the Llama-3-8B shape in bf16, then fp8 weights + fp8 KV
#   tests-tp            the tensor-parallel GPU tests (as many ranks as the host has GPUs, to 4)
#   bench-tp            bench on the Llama-3-8B shape at 1, 2 and 4 ranks, then the Qwen3-32B
#                       and Llama-3-70B shapes at 2 and 4 (each where the host has the GPUs)
#   host-overhead       host_overhead.py: the engine's host work per step, on this host's CPU
#   serving             gRPC at concurrency 256 against offline (serving.py)
#   serving-cold        the same from an empty kernel cache filled by `pagedserve warmup`,
#                       then Poisson arrivals at 80% of the measured rate
#   kernels             gpu_kernels.py: Triton vs eager vs torch.compile
#   linear              gpu_kernels.py --tokens: the projections' GEMMs
#   structured          structured_output.py: 64 requests under JSON schemas against the same
#                       free, and grammar compile times (STRUCTURED_ARGS="--tokenizer DIR"
#                       where the host cannot fetch the embedded default)
#   structured-base     the same benchmark on each engine benchmarks/gpu/ab_base.sh staged
#   token-masks         token_masks.py: mask fills on this host's CPU, unpacking on the GPU
#   attention           gpu_attention.py: the decode attention kernels
#   attention-workload  gpu_attention.py at the workload's own decode steps only
#   attention-fp8       gpu_attention.py at the workload's steps on an fp8 pool, the Triton
#                       kernel's launch settings swept
#   moe                 gpu_moe.py: the fused MoE implementations at decode and prefill rows
#   fp8-accuracy        fp8_accuracy.py on random weights in SmolLM2-135M's shape (.bench-tokenizer)
#   fp8-linear          gpu_fp8_linear.py: fp8 projections, the skinny kernel vs torch._scaled_mm
#   profile             gpu_profile.py: the kernels' share of a prefill, a busy decode and a
#                       batch-1 decode step (PROFILE_ARGS picks the shape and precision)
#   profile-fp8-8b      profile on the Llama-3-8B shape in bf16, then fp8 weights + fp8 KV
#   profile-moe         profile on the Qwen3-30B-A3B shape
#
# flashinfer's and Triton's kernel caches live in .ficache/ (git-ignored). A run leaves
# them in $OUT as ficache.tar.gz.* (12 MiB parts); `cat` them into .ficache.tgz in the
# repository root and the next run on a fresh host starts from those kernels.
set -uo pipefail
TESTS_ARGS=${TESTS_ARGS:-}  # more pytest options for tests, e.g. "-k graph"
# The test files for tests (default: every module with GPU tests; the others import
# test-only packages the host may lack).
TESTS_FILES=${TESTS_FILES:-$(grep -l "pytest.mark.gpu" tests/*.py)}
# With TESTS_FILE_SECONDS set, tests runs each file as its own pytest stopped after that
# many seconds, so one file's kernel builds cannot take the time of the files after it.
TESTS_FILE_SECONDS=${TESTS_FILE_SECONDS:-}
BENCH_ARGS=${BENCH_ARGS:-}  # more gpu_bench.py options for bench and bench-base, e.g. "--block-size 16"
LINEAR_ARGS=${LINEAR_ARGS:-}  # more gpu_kernels.py options for linear, e.g. "--linear-rows 64 256"
STRUCTURED_ARGS=${STRUCTURED_ARGS:-}  # more structured_output.py options for structured
MASKS_ARGS=${MASKS_ARGS:-}  # more token_masks.py options for token-masks, e.g. "--tokenizer DIR"
FP8_LINEAR_ARGS=${FP8_LINEAR_ARGS:-}  # more gpu_fp8_linear.py options, e.g. "--sweep --rows 1 2 4 8 16 32 64"
MOE_ARGS=${MOE_ARGS:-}  # more gpu_moe.py options for moe, e.g. "--tile-sweep --shapes qwen3-30b-a3b"
PROFILE_ARGS=${PROFILE_ARGS:-}  # gpu_profile.py options for profile, e.g. "--shape llama-3-8b"
# Diffs to apply to this (throwaway) copy of the tree first, so that its steps (the GPU
# tests above all) run an experiment: APPLY_PATCHES="/path/to/experiment.patch".
APPLY_PATCHES=${APPLY_PATCHES:-}
cd "$(dirname "$0")/../.."
for patch in $APPLY_PATCHES; do
  { git apply "$patch" 2>/dev/null || patch -p1 --forward < "$patch"; } || exit 1
  echo "applied $patch"
done
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD:$PWD/proto PYTHONUNBUFFERED=1
# Triton's kernel cache is kept with flashinfer's, or each fresh host compiles the
# engine's Triton kernels again in its first engine start.
export FLASHINFER_WORKSPACE_BASE=$PWD/.ficache TRITON_CACHE_DIR=$PWD/.ficache/triton MAX_JOBS=16
mkdir -p .ficache
[ -f .ficache.tgz ] && tar xzf .ficache.tgz -C .ficache
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee -a "$OUT/log.txt"
python3 -c 'import torch, flashinfer, triton; print(torch.__version__, flashinfer.__version__, triton.__version__)' \
  | tee -a "$OUT/log.txt"

status=0
for step in "$@"; do
  start=$(date +%s)
  case $step in
    # -v: each test's outcome on its own line as it ends, so a run stopped by a time limit
    # still says which tests passed.
    tests) if [ -z "$TESTS_FILE_SECONDS" ]; then
        python3 -m pytest -v -s -m gpu --durations=20 $TESTS_FILES $TESTS_ARGS \
          -p no:cacheprovider 2>&1 | grep --line-buffered -v "it/s\]" | tee -a "$OUT/log.txt"
      else
        failed=0
        for file in $TESTS_FILES; do
          timeout "$TESTS_FILE_SECONDS" python3 -m pytest -v -s -m gpu --durations=5 "$file" \
            $TESTS_ARGS -p no:cacheprovider 2>&1 | grep --line-buffered -v "it/s\]" \
            | tee -a "$OUT/log.txt"
          rc=${PIPESTATUS[0]}
          echo "file $file: exit $rc" | tee -a "$OUT/log.txt"
          [ "$rc" = 0 ] || [ "$rc" = 5 ] || failed=1  # 5: no GPU test collected
        done
        (exit $failed)
      fi ;;
    attention) python3 benchmarks/gpu_attention.py --json-out "$OUT/gpu-attention.json" 2>&1 | tee -a "$OUT/log.txt" ;;
    attention-workload) python3 benchmarks/gpu_attention.py --workload-only \
        --json-out "$OUT/gpu-attention-workload.json" 2>&1 | tee -a "$OUT/log.txt" ;;
    attention-fp8) python3 benchmarks/gpu_attention.py --workload-only --kv-cache-dtype fp8_e4m3 \
        --variants cuda-core tensor-core triton --triton-sweep --json-out "$OUT/gpu-attention-fp8.json" \
        2>&1 | tee -a "$OUT/log.txt" ;;
    moe) python3 benchmarks/gpu_moe.py $MOE_ARGS --json-out "$OUT/gpu-moe.json" 2>&1 | tee -a "$OUT/log.txt" ;;
    fp8-accuracy) python3 benchmarks/fp8_accuracy.py --device cuda --random-shape smollm2-135m \
        --tokenizer .bench-tokenizer --json-out "$OUT/gpu-fp8-accuracy-random-smollm2.json" 2>&1 \
        | tee -a "$OUT/log.txt" ;;
    fp8-linear) python3 benchmarks/gpu_fp8_linear.py $FP8_LINEAR_ARGS --json-out "$OUT/gpu-fp8-linear.json" 2>&1 \
        | tee -a "$OUT/log.txt" ;;
    kernels) python3 benchmarks/gpu_kernels.py --json-out "$OUT/gpu-kernels.json" 2>&1 | tee -a "$OUT/log.txt" ;;
    # The engine's own host work per step, on this machine's CPU (no GPU involved).
    host-overhead) python3 benchmarks/host_overhead.py --repeats 3 --max-out 300 --json-out "$OUT/host-overhead.json" \
        2>&1 | tee -a "$OUT/log.txt" ;;
    bench) python3 benchmarks/gpu_bench.py $BENCH_ARGS --json-out "$OUT/gpu-qwen3-0.6b.json" 2>&1 \
        | tee -a "$OUT/log.txt" ;;
    # Each engine benchmarks/gpu/ab_base.sh staged in .ab_base, under this tree's benchmark.
    bench-base) failed=0
      for base in .ab_base/*/; do
        label=$(cat "$base/COMMIT")
        (cd "$base" && BENCH_COMMIT=$label PYTHONPATH=/tmp/site:$PWD \
          python3 benchmarks/gpu_bench.py $BENCH_ARGS --json-out "$OUT/gpu-qwen3-0.6b-base-${label//[^A-Za-z0-9.-]/_}.json") 2>&1 \
          | sed "s|^|[$label] |" | tee -a "$OUT/log.txt" || failed=1
      done
      (exit $failed) ;;
    bench-hf) python3 benchmarks/gpu_bench.py --compare-transformers \
        --json-out "$OUT/gpu-qwen3-0.6b.json" 2>&1 | tee -a "$OUT/log.txt" ;;
    bench-32k) python3 benchmarks/gpu_bench.py --max-num-batched-tokens 32768 \
        --json-out "$OUT/gpu-qwen3-0.6b-32k.json" 2>&1 | tee -a "$OUT/log.txt" ;;
    bench-sync) python3 benchmarks/gpu_bench.py --no-async-scheduling \
        --json-out "$OUT/gpu-qwen3-0.6b-sync.json" 2>&1 | tee -a "$OUT/log.txt" ;;
    serving) python3 -c "from pathlib import Path; from benchmarks.gpu_bench import SHAPES, write_random_model; \
write_random_model(SHAPES['qwen3-0.6b'], Path('/tmp/pagedserve-bench-models/qwen3-0.6b'))" &&
        python3 benchmarks/serving.py --start-server --model /tmp/pagedserve-bench-models/qwen3-0.6b \
        --concurrency 256 --num-prompts 256 --min-in 100 --max-in 1024 --min-out 100 \
        --max-out 1024 --max-num-batched-tokens 16384 --compare-offline \
        --json-out "$OUT/gpu-serving-qwen3-0.6b.json" 2>&1 | tee -a "$OUT/log.txt" ;;
    # A pod's start on a fresh host: no kernel cache to start from. `pagedserve warmup` fills
    # an empty one (timed), a server started on it serves the nano-vllm workload at
    # concurrency 256 from the moment it reports SERVING (no untimed requests), offline runs
    # on the same cache, then a server serves Poisson arrivals at 80% of the measured rate.
    serving-cold) model=/tmp/pagedserve-bench-models/qwen3-0.6b
      shape=(--model $model --max-num-seqs 256 --max-num-batched-tokens 16384)
      load=(--num-prompts 256 --min-in 100 --max-in 1024 --min-out 100 --max-out 1024)
      python3 -c "from pathlib import Path; from benchmarks.gpu_bench import SHAPES, write_random_model; \
write_random_model(SHAPES['qwen3-0.6b'], Path('$model'))" &&
      rm -rf .ficache/* && export PAGEDSERVE_KERNEL_CACHE_DIR=$PWD/.ficache &&
      w0=$(date +%s) &&
      python3 -m service.cli warmup "${shape[@]}" --no-prefix-caching --log-level INFO 2>&1 \
        | tee -a "$OUT/log.txt" &&
      echo "pagedserve warmup: $(( $(date +%s) - w0 )) s" | tee -a "$OUT/log.txt" &&
      du -sh .ficache/triton .ficache/.cache/flashinfer 2>&1 | tee -a "$OUT/log.txt" &&
      python3 benchmarks/serving.py --start-server "${shape[@]}" --concurrency 256 "${load[@]}" \
        --compare-offline --json-out "$OUT/gpu-serving-cold.json" 2>&1 | tee -a "$OUT/log.txt" &&
      rate=$(python3 -c "import json; print(0.8 * json.load(open('$OUT/gpu-serving-cold.json'))['serving']['window']['request_throughput'])") &&
      python3 benchmarks/serving.py --start-server "${shape[@]}" --request-rate "$rate" "${load[@]}" \
        --json-out "$OUT/gpu-serving-poisson.json" 2>&1 | tee -a "$OUT/log.txt" ;;
    smollm2) python3 benchmarks/gpu_bench.py --shape smollm2-135m \
        --json-out "$OUT/gpu-smollm2-135m.json" 2>&1 | tee -a "$OUT/log.txt" ;;
    # 61 GB of weights: the engine may take 95% of an 80 GB card, or its KV pool holds
    # few of the workload's sequences at once.
    bench-moe) python3 benchmarks/gpu_bench.py --shape qwen3-30b-a3b --gpu-memory-utilization 0.95 \
        $BENCH_ARGS --json-out "$OUT/gpu-qwen3-30b-a3b.json" 2>&1 | tee -a "$OUT/log.txt" ;;
    bench-gemma3) python3 benchmarks/gpu_bench.py --shape gemma-3-12b $BENCH_ARGS \
        --json-out "$OUT/gpu-gemma-3-12b.json" 2>&1 | tee -a "$OUT/log.txt" ;;
    bench-fp8-kv) python3 benchmarks/gpu_bench.py $BENCH_ARGS --json-out "$OUT/gpu-qwen3-0.6b.json" 2>&1 \
        | tee -a "$OUT/log.txt" && python3 benchmarks/gpu_bench.py --kv-cache-dtype fp8_e4m3 $BENCH_ARGS \
        --json-out "$OUT/gpu-qwen3-0.6b-fp8-kv.json" 2>&1 | tee -a "$OUT/log.txt" ;;
    bench-fp8-8b) python3 benchmarks/gpu_bench.py --shape llama-3-8b $BENCH_ARGS \
        --json-out "$OUT/gpu-llama-3-8b.json" 2>&1 | tee -a "$OUT/log.txt" &&
      python3 benchmarks/gpu_bench.py --shape llama-3-8b --quantization fp8 --kv-cache-dtype fp8_e4m3 \
        $BENCH_ARGS --json-out "$OUT/gpu-llama-3-8b-fp8.json" 2>&1 | tee -a "$OUT/log.txt" ;;
    profile) python3 benchmarks/gpu_profile.py $PROFILE_ARGS --json-out "$OUT/gpu-profile.json" 2>&1 \
        | tee -a "$OUT/log.txt" ;;
    profile-fp8-8b) python3 benchmarks/gpu_profile.py --shape llama-3-8b \
        --json-out "$OUT/gpu-profile-llama-3-8b.json" 2>&1 | tee -a "$OUT/log.txt" &&
      python3 benchmarks/gpu_profile.py --shape llama-3-8b --quantization fp8 --kv-cache-dtype fp8_e4m3 \
        --json-out "$OUT/gpu-profile-llama-3-8b-fp8.json" 2>&1 | tee -a "$OUT/log.txt" ;;
    profile-moe) python3 benchmarks/gpu_profile.py --shape qwen3-30b-a3b --gpu-memory-utilization 0.95 \
        --json-out "$OUT/gpu-profile-qwen3-30b-a3b.json" 2>&1 | tee -a "$OUT/log.txt" ;;
    tests-tp) python3 -m pytest -v -s -m gpu --durations=20 tests/test_gpu_tensor_parallel.py $TESTS_ARGS \
        -p no:cacheprovider 2>&1 | grep --line-buffered -v "it/s\]" | tee -a "$OUT/log.txt" ;;
    bench-tp) gpus=$(nvidia-smi --list-gpus | wc -l) failed=0
      for run in llama-3-8b:1 llama-3-8b:2 llama-3-8b:4 qwen3-32b:2 qwen3-32b:4 \
          llama-3-70b:2 llama-3-70b:4; do
        shape=${run%:*} size=${run#*:}
        [ "$size" -le "$gpus" ] || continue
        python3 benchmarks/gpu_bench.py --shape "$shape" --tensor-parallel-size "$size" \
          $BENCH_ARGS --json-out "$OUT/gpu-$shape-tp$size.json" 2>&1 \
          | tee -a "$OUT/log.txt" || failed=1
      done
      (exit $failed) ;;
    linear) python3 benchmarks/gpu_kernels.py --tokens --sample-rows $LINEAR_ARGS \
        --json-out "$OUT/gpu-kernels-linear.json" 2>&1 | tee -a "$OUT/log.txt" ;;
    structured) python3 benchmarks/structured_output.py $STRUCTURED_ARGS \
        --json-out "$OUT/gpu-structured-output.json" 2>&1 | tee -a "$OUT/log.txt" ;;
    token-masks) python3 benchmarks/token_masks.py --device cuda $MASKS_ARGS \
        --json-out "$OUT/token-masks.json" 2>&1 | tee -a "$OUT/log.txt" ;;
    structured-base) failed=0
      for base in .ab_base/*/; do
        [ -f "$base/engine/structured/grammar.py" ] || [ -f "$base/engine/grammar.py" ] \
          || continue  # an engine without structured output
        label=$(cat "$base/COMMIT")
        (cd "$base" && BENCH_COMMIT=$label PYTHONPATH=/tmp/site:$PWD \
          python3 benchmarks/structured_output.py $STRUCTURED_ARGS \
          --json-out "$OUT/gpu-structured-output-base-${label//[^A-Za-z0-9.-]/_}.json") 2>&1 \
          | sed "s|^|[$label] |" | tee -a "$OUT/log.txt" || failed=1
      done
      (exit $failed) ;;
    *) echo "unknown step $step"; exit 2 ;;
  esac
  rc=${PIPESTATUS[0]}
  echo "step $step: exit $rc after $(( $(date +%s) - start )) s" | tee -a "$OUT/log.txt"
  [ "$rc" = 0 ] || status=$rc
done
# The kernel caches, for the next run (see the top of this file).
du -sh .ficache/triton .ficache/.cache/flashinfer 2>&1 | tee -a "$OUT/log.txt"
tar czf - -C .ficache . 2>/dev/null | split -b 12M - "$OUT/ficache.tar.gz."
ls -la "$OUT"
exit $status
