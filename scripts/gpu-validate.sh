#!/usr/bin/env bash
# The CUDA path end to end on one GPU machine, stage by stage, each under its own time limit:
#
#   scripts/gpu-validate.sh setup env gpu-tests kernels serve7b engine-tests
#
# Stages:
#   setup         install wheels from .whl/ (what the machine lacks) and this checkout, editable
#   env           GPU, driver, torch, triton; measured device copy bandwidth and bf16 GEMM rate
#   gpu-tests     pytest -m gpu (the Triton kernels compiled, against their torch references; the CUDA
#                 path's launches per decoder layer; no Triton compile while serving after the warm-up)
#   kernels       python -m benchmarks.kernels (KERNELS_ARGS, default --quick)
#   kernels-full  the whole sweep of benchmarks.kernels
#   serve7b       a LLaMA-7B-shaped dummy model in bf16 behind `pagedllm serve`, one completion,
#                 then benchmarks.serve (ShareGPT lengths) at the rates in SERVE_RATES
#   engine-tests  tests/server on the GPU (device auto picks CUDA), ENGINE_TESTS selects
#   throughput7b  python -m benchmarks.throughput --shape llama-7b (ours, transformers, ceiling)
#   profile7b     python -m benchmarks.gpu_step_profile (PROFILE_ARGS): decode step time by batch size
#   quick         setup, then python -m benchmarks.gpu_quick's sections (env engine kernels tests serve), each
#                 under its own limit, and the summary: benchmarks/results/gpu/summary-DATE-DEVICE.{json,md}
#                 for a LLaMA-3-8B shape; fits one 8-minute call. Brings back $OUT/run.log, $OUT/quick.tar
#                 and the summary files (QUICK_SECTIONS="engine:150 serve:175" picks sections and limits,
#                 QUICK_ARGS passes options: python -m benchmarks.gpu_quick --help)
#   quant-linear  python -m benchmarks.gpu_quant_linear (QUANT_LINEAR_ARGS, default --sweep-tiles): the
#                 W4A16 kernel on 7B linear sizes at decode batches against the copy-bandwidth floor and
#                 cuBLAS bf16, and the fastest of ~33 swept tile sizes (split-K among them) at one row
#   quant         the quantized paths on a LLaMA-3-8B shape in one short call (QUANT_TIMEOUT, default 300 s):
#                 their GPU kernel tests, benchmarks.gpu_fp8_linear (rows 1 16 64 256), benchmarks.gpu_quant_linear
#                 --sweep-tiles (rows 1 4 16), and a decode step at batch 64 with bf16 and with fp8 weights
#   async         the GPU tests of async scheduling (a step scheduled ahead is queued without waiting for the device),
#                 then decode steps at batch 1, 16, 64, 256 with async_scheduling off and on, back to back (ASYNC_TIMEOUT,
#                 default 240 s): what scheduling the next step during this one recovers of the GPU's idle time
#
# Everything is logged to $OUT/run.log (OUT defaults to ./gpu-out); result files are packed
# into $OUT/results.tar after each stage.
set -u
OUT=${OUT:-$PWD/gpu-out}
mkdir -p "$OUT/res"
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=${OMP_NUM_THREADS:-4} TOKENIZERS_PARALLELISM=false
exec > >(tee -a "$OUT/run.log") 2>&1
PY=${PY:-python3}
MODEL7B=/tmp/llama7b

pack() { tar -C "$OUT" -cf "$OUT/results.tar" res; }

stage_setup() {
    if compgen -G ".whl/*.whl" >/dev/null; then
        $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || return 1
        export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
    fi
    $PY -m pip install -q --no-index --no-deps --no-build-isolation -e . || return 1
    $PY -c "import pagedllm.server, fastapi, uvicorn, xgrammar; print('pagedllm', pagedllm.server.__file__)"
}

stage_env() {
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv
    $PY - <<'EOF'
import torch, triton, platform
print("python", platform.python_version(), "torch", torch.__version__, "cuda", torch.version.cuda, "triton", triton.__version__)
p = torch.cuda.get_device_properties(0)
print("device", p.name, "SMs", p.multi_processor_count, "memory GiB", round(p.total_memory / 2**30, 1))
from triton.testing import do_bench
n = 1 << 30
a = torch.randn(n // 2, dtype=torch.bfloat16, device="cuda"); b = torch.empty_like(a)
ms = do_bench(lambda: b.copy_(a), warmup=50, rep=300, return_mode="median")
print(f"device copy: {2 * n / ms / 1e6:.0f} GB/s (read + write, 1 GiB)")
x = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda"); y = torch.randn_like(x)
ms = do_bench(lambda: x @ y, warmup=50, rep=300, return_mode="median")
print(f"bf16 GEMM 8192^3: {2 * 8192**3 / ms / 1e9:.0f} TFLOP/s")
EOF
}

stage_gpu-tests() {
    timeout "${GPU_TESTS_TIMEOUT:-300}" $PY -m pytest -m gpu tests/kernels tests/server/worker/test_launch_count.py \
        tests/server/worker/test_triton_warmup.py -q -p no:cacheprovider -rfE --timeout 300 \
        --junitxml "$OUT/res/gpu-tests.xml"
}

stage_kernels() {
    # shellcheck disable=SC2086
    timeout "${KERNELS_TIMEOUT:-200}" $PY -m benchmarks.kernels ${KERNELS_ARGS:---quick} --out-dir "$OUT/res"
}

stage_kernels-full() {
    timeout "${KERNELS_TIMEOUT:-420}" $PY -m benchmarks.kernels --out-dir "$OUT/res"
}

stage_serve7b() {
    [ -f $MODEL7B/config.json ] || $PY -m benchmarks.llama7b $MODEL7B || return 1
    local port=8011 pid ok=0 rc=0
    $PY -m pagedllm.server.entrypoints.cli serve --model $MODEL7B --load-format dummy --dtype bfloat16 --port $port --served-model-name llama-7b \
        ${SERVE_ARGS:-} >"$OUT/res/serve7b-server.log" 2>&1 &
    pid=$!
    for _ in $(seq 1 "${SERVE_READY_S:-240}"); do
        if curl -sf "http://127.0.0.1:$port/ready" >/dev/null; then ok=1; break; fi
        kill -0 $pid 2>/dev/null || break
        sleep 1
    done
    if [ $ok != 1 ]; then
        echo "server never became ready"; tail -50 "$OUT/res/serve7b-server.log"; kill $pid 2>/dev/null; return 1
    fi
    curl -s "http://127.0.0.1:$port/v1/completions" -H 'Content-Type: application/json' \
        -d '{"model":"llama-7b","prompt":"The json module","max_tokens":32,"temperature":0}'
    echo
    for rate in ${SERVE_RATES:-4 16 inf}; do
        timeout "${SERVE_RUN_TIMEOUT:-150}" $PY -m benchmarks.serve --base-url "http://127.0.0.1:$port" \
            --dataset sharegpt --num-prompts "${SERVE_PROMPTS:-200}" --request-rate "$rate" --disable-tqdm \
            --result-name "serve-llama7b-bf16-rate$rate" || rc=1
        cp benchmarks/results/serve-llama7b-bf16-rate"$rate".* "$OUT/res/" 2>/dev/null
    done
    curl -s "http://127.0.0.1:$port/metrics" | grep -E '^pagedllm:(num_preemptions|gpu_cache_usage|prompt_tokens_total|generation_tokens_total)' | head
    kill -TERM $pid; wait $pid
    tail -5 "$OUT/res/serve7b-server.log"
    return $rc
}

stage_engine-tests() {
    # shellcheck disable=SC2086
    timeout "${ENGINE_TESTS_TIMEOUT:-300}" $PY -m pytest ${ENGINE_TESTS:-tests/server} -q -p no:cacheprovider -rfE \
        -n "${ENGINE_TESTS_WORKERS:-8}" --timeout 240 --junitxml "$OUT/res/engine-tests.xml"
}

stage_throughput7b() {
    # shellcheck disable=SC2086
    timeout "${THROUGHPUT_TIMEOUT:-400}" $PY -m benchmarks.throughput --shape llama-7b --dtype bfloat16 \
        --out "$OUT/res" ${THROUGHPUT_ARGS:-}
}

stage_profile7b() {
    # shellcheck disable=SC2086
    timeout "${PROFILE_TIMEOUT:-300}" $PY -m benchmarks.gpu_step_profile --out "$OUT/res" ${PROFILE_ARGS:-}
}

stage_quant-linear() {
    # shellcheck disable=SC2086
    timeout "${QUANT_LINEAR_TIMEOUT:-300}" $PY -m benchmarks.gpu_quant_linear --out "$OUT/res/quant-linear.json" \
        ${QUANT_LINEAR_ARGS:---sweep-tiles}
}

stage_quant() {
    local end=$((SECONDS + ${QUANT_TIMEOUT:-300})) rc=0 engine
    left() { echo $((end - SECONDS > 5 ? end - SECONDS : 5)); }
    timeout "$(left)" $PY -m pytest -m gpu tests/kernels/test_fp8_matmul.py tests/kernels/test_quant_matmul.py \
        tests/server/worker/quantization -q -p no:cacheprovider -rfE --junitxml "$OUT/res/quant-tests.xml" || rc=1
    timeout "$(left)" $PY -m benchmarks.gpu_fp8_linear --shapes llama-3-8b --out "$OUT/res/fp8-linear.json" || rc=1
    timeout "$(left)" $PY -m benchmarks.gpu_quant_linear --shapes llama-3-8b --sweep-tiles \
        --out "$OUT/res/quant-linear.json" || rc=1
    for engine in 'bf16|{}' 'fp8|{"quantization": "fp8"}'; do
        mkdir -p "$OUT/res/step-${engine%%|*}"
        timeout "$(left)" $PY -m benchmarks.gpu_step_profile --shape llama-3-8b --batch-sizes 64 --decode-steps 32 \
            --profile-steps 4 --engine-args "${engine#*|}" --out "$OUT/res/step-${engine%%|*}" || rc=1
    done
    return $rc
}

stage_async() {
    local end=$((SECONDS + ${ASYNC_TIMEOUT:-240})) rc=0 engine
    # NOTE: first the checks that launching a step scheduled ahead never waits for the device
    timeout 90 $PY -m pytest -m gpu tests/server/engine/test_async_scheduling.py tests/server/worker/test_sampler.py \
        -q -p no:cacheprovider -rfE --junitxml "$OUT/res/async-tests.xml" || rc=1
    for engine in 'sync|{}' 'async|{"async_scheduling": true}'; do
        mkdir -p "$OUT/res/step-${engine%%|*}"
        timeout $((end - SECONDS > 5 ? end - SECONDS : 5)) $PY -m benchmarks.gpu_step_profile --shape llama-3-8b \
            --decode-steps 32 --profile-steps 4 --engine-args "${engine#*|}" --out "$OUT/res/step-${engine%%|*}" || rc=1
    done
    return $rc
}

stage_quick() {
    local res=/tmp/quick-res rc=0 section limit
    mkdir -p $res
    [ -n "${QUICK_NO_SETUP:-}" ] || stage_setup || return 1
    for section in ${QUICK_SECTIONS:-env:25 engine:170 kernels:30 tests:120 serve:175}; do
        limit=${section#*:}; section=${section%%:*}
        echo "=== quick $section (limit ${limit} s) $(date -u +%FT%TZ)"
        # shellcheck disable=SC2086
        timeout -k 5 "$limit" $PY -m benchmarks.gpu_quick "$section" --out $res ${QUICK_ARGS:-} || { echo "=== quick $section rc=$?"; rc=1; }
        tar -C /tmp -cf "$OUT/quick.tar" quick-res
    done
    $PY -m benchmarks.gpu_quick summary --out $res
    mkdir -p benchmarks/results/gpu
    cp $res/summary-* benchmarks/results/gpu/ && cp $res/summary-* "$OUT/"
    tar -C /tmp -cf "$OUT/quick.tar" quick-res
    return $rc
}

status=0
for stage in "$@"; do
    echo "=== $stage $(date -u +%FT%TZ)"
    start=$SECONDS
    "stage_$stage"
    rc=$?
    echo "=== $stage rc=$rc in $((SECONDS - start)) s"
    [ $rc = 0 ] || status=1
    [ "$stage" = quick ] || pack
done
exit $status
