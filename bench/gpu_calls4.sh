#!/usr/bin/env bash
# The device calls of the fourth GPU session (issues 16 and 18), two H200s of one host. Run on the
# device machine from the repository root:  bash bench/gpu_calls4.sh work_a   (etc.)
#
# The install helpers and runs of bench/gpu_calls3.sh, regrouped so the first working call needs no Ray:
# the carry folders travel in three groups, each under what one call can bring (64 MiB):
#   call 1  .tl1 .fp8whl .gputok .pytestwheels            install
#   call 2  .tl2 .devpkgs/wheels .ccwheel                 work_a: GPU 0 the suite's kernel tests (one GPU,
#                                                         with causal-conv1d) and the start-up check's time;
#                                                         GPU 1 the float8 loss parity on real text
#   call 3  .devpkgs/ray.tar.xz .gpuwheels                work_b: the 27B cut through Ray Train on both GPUs,
#                                                         fp32 master weights, bf16 then float8; then the
#                                                         suite's Ray Train part on both GPUs
#   call 4  (nothing new)                                 work_c: the suite's Ray Train part on one GPU (GPU 0)
#                                                         beside the 8-layer fp32-master pair (GPU 1)
# Each function stops itself before the call's limit (CALL_S seconds, default 560): later parts get
# what time is left, so a slow first part costs the last one, not the whole call's output.
set -u -o pipefail
source "$(dirname "${BASH_SOURCE[0]}")/gpu_calls3.sh"
DEADLINE=$((SECONDS + ${CALL_S:-560}))
left() { local s=$((DEADLINE - SECONDS - ${1:-0})); [ "$s" -gt 10 ] && echo "$s" || echo 10; }

install() { session_install; }

suite_summary() {
  grep -h -E "PASSED|FAILED|SKIPPED|ERROR|RESULT|^=+ .*(passed|failed|skipped|error)" "$O"/suite_*.log \
    | cut -c1-400 | tail -60
}

PARITY="bench/fp8_parity.py --tokenizer /tmp/tok/qwen3 --rows /tmp/fp8data/*.jsonl --stdlib-rows 9000
  --builtin-rows 0 --lr 3e-4 --steps 300 --recipes tensorwise,rowwise --bf16-seeds 2"

work_a() {
  install
  need_or_say torchao fla tilelang z3 tvm_ffi liger_kernel || return 0
  info > "$O/info.txt" 2>&1; head -4 "$O/info.txt"
  kernels_1gpu() {
    pytest_gpu 1gpu_kernels "$(left 60)" "$CC_SITE" tests/gpu/test_packed_equality.py tests/gpu/test_kernel_check_gpu.py
    check_time cc "$CC_SITE" > "$O/kernel_check_time.log" 2>&1
  }
  parity() { run "$(left 10)" fp8_parity $PY $PARITY --out "$O"; }
  on_gpus 0 kernels_1gpu kernels_1gpu & on_gpus 1 fp8_parity parity & wait
  suite_summary
  cat "$O/kernel_check_time.log" 2>/dev/null | cut -c1-300
  grep -h "RESULT\|Error" "$O"/fp8_parity.log | grep -v '"losses"' | cut -c1-2500
}

# The 27B recipe itself (jobs/qwen27b_b300.py: fp32 master weights, full checkpointing, compiled) cut to
# 16 layers, random weights, 32k blocks, through Ray Train on both GPUs; 8 steps logged every 2 (the
# first window holds the compiles).
RAY27B="$RAY27 --set data.source=builtin:lognormal:1200"
work_b() {
  install
  need_or_say ray mlflow torchao fla tilelang z3 tvm_ffi || return 0
  info > "$O/info.txt" 2>&1; head -4 "$O/info.txt"
  mkdir -p /tmp/runs
  $PY -c "from raytune_ft.models.tiny import real_config; real_config('qwen3.8-27b', num_hidden_layers=16).save_pretrained('/tmp/m27b16')"
  on_gpus 0,1 fp8ray_bf16 run "$(left 200)" ray27b16_bf16 $PY $RAY27B --set tracking.run_name=ray27b16-bf16
  on_gpus 0,1 fp8ray_fp8 run "$(left 10)" ray27b16_fp8 $PY $RAY27B --set train.precision=fp8 \
    --set train.fp8_recipe=tensorwise --set tracking.run_name=ray27b16-fp8
  grep -h "precision\|float8\|tok/s\|MFU\|Error\|OutOfMemory\|RESULT" "$O"/fp8ray_*.log | cut -c1-400 | tail -40
  if [ "$(left)" -gt 200 ]; then
    on_gpus 0,1 ray_2gpu pytest_gpu ray_2gpu "$(left)" "$CC_SITE" tests/gpu/test_fsdp_ray_gpu.py
    suite_summary
  else
    echo "no time left for the suite's Ray Train part on both GPUs"
  fi
}

# check_cold_warm (a fresh one-GPU machine; carry .tl1 + .devpkgs/wheels, then .tl2 + .ccwheel): the start-up
# check of the 27B shape in three fresh processes in a row, and what the on-disk JIT caches hold after each
check_cold_warm() {
  install
  need_or_say fla tilelang z3 tvm_ffi liger_kernel || return 0
  local i
  for i in 1 2 3; do
    PYTHONPATH=$CC_SITE:$PYTHONPATH timeout "$(left 20)" $PY -m raytune_ft.models.kernel_check \
      --model qwen3.8-27b --repeat 1 2>&1 | grep -E "RESULT|kernels in use|Error" | cut -c1-300 | sed "s/^/[process $i] /"
    echo "[process $i] on disk: triton $(find ~/.triton/cache -type f 2>/dev/null | wc -l) files," \
      "tilelang $(find ~/.tilelang -type f 2>/dev/null | wc -l) files ($(date +%T))"
  done
}

work_c() {   # the suite's Ray Train part on one GPU; the fp32-master pair at the 8-layer cut on the other
  install
  need_or_say ray mlflow torchao fla tilelang z3 tvm_ffi || return 0
  fp32_pair() {
    run "$(left 200)" 27b8_fp32master_bf16 $PY $F27 --layers 8 --master fp32
    run "$(left 10)" 27b8_fp32master_fp8_tensorwise $PY $F27 --layers 8 --master fp32 --precision fp8 \
      --fp8-recipe tensorwise
  }
  on_gpus 0 ray_1gpu pytest_gpu ray_1gpu "$(left 10)" "$CC_SITE" tests/gpu/test_fsdp_ray_gpu.py \
    & on_gpus 1 fp8_fp32master fp32_pair & wait
  grep -h "RESULT\|Error" "$O"/fp8_fp32master.log | cut -c1-1200
  if [ "$(left)" -gt 180 ]; then   # then on both GPUs, if time is left (work_b's runs may have used it)
    on_gpus 0,1 ray_2gpu pytest_gpu ray_2gpu "$(left)" "$CC_SITE" tests/gpu/test_fsdp_ray_gpu.py
  fi
  suite_summary
}

"$@"
