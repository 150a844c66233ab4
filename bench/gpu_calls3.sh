#!/usr/bin/env bash
# The device calls of the third GPU session, one function per job. Run on the device machine from the
# repository root:  bash bench/gpu_calls3.sh kernels   (etc.)
#
# What a call carries is capped (64 MiB), so the packages come over in several calls sent back to back
# (the machine stays warm ~30 s and keeps /tmp): every function first installs whatever carry folders
# came with its call (install_present), and starts its work only once everything it needs is there;
# until then it says what is still missing and returns. Folders (git-ignored; bench/README.md says how
# each is made):
#   .tl1         tilelang (fla's gated-delta-net backward on Hopper with Triton 3.6)         ~48 MB
#   .tl2         tilelang's needs (z3-solver, apache-tvm-ffi, torch-c-dlpack-ext, ml-dtypes) ~32 MB
#   .gpuwheels   mlflow-skinny and its needs not in the image (cryptography, cffi, pycparser too) ~20 MB
#   .devpkgs     Ray (trimmed tarball) + trl/datasets/liger/fla wheels                        ~36 MB
#   .pytestwheels  pytest, pytest-timeout and their needs                                     ~2 MB
#   .ccwheel     a causal-conv1d wheel built for this GPU (optional; bench/build_causal_conv1d.sh)
#   .ccsrc       causal-conv1d's sdist, built here when no wheel came (optional; takes minutes)
# Logs and RESULT lines go to $OUT.
set -u -o pipefail
source "$(dirname "${BASH_SOURCE[0]}")/gpu_lib.sh"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1 RAY_COLOR_PREFIX=0
export TOKENIZERS_PARALLELISM=false
O=${OUT:-/tmp/out}
mkdir -p "$O" /tmp/site
CC_SITE=/tmp/cc          # causal-conv1d lives apart, so a run can be made with and without it

# ---------------------------------------------------------------- shared install helpers

pip_into() {   # pip_into DIR WHEEL...: offline, no dependency resolution (the carry folders hold them)
  local dir=$1; shift
  [ $# -gt 0 ] || return 0
  $PY -m pip install -q --no-index --no-deps --no-compile --target "$dir" "$@"
}

install_ray() {   # the Ray tarball of .devpkgs into /tmp/site
  tar xJf .devpkgs/ray.tar.xz -C /tmp/site \
    && chmod +x /tmp/site/ray/core/src/ray/raylet/raylet /tmp/site/ray/core/src/ray/gcs/gcs_server
}

install_present() {   # whatever came with this call; each folder once per machine
  local d
  if [ -f .devpkgs/ray.tar.xz ] && [ ! -d /tmp/site/ray ]; then install_ray && echo "installed: Ray"; fi
  for d in .devpkgs/wheels .gpuwheels .tl1 .tl2 .pytestwheels; do
    if ls "$d"/*.whl >/dev/null 2>&1 && [ ! -f "/tmp/site/.done_${d//\//_}" ]; then
      pip_into /tmp/site "$d"/*.whl && touch "/tmp/site/.done_${d//\//_}" && echo "installed: $d"
    fi
  done
  if ls .ccwheel/*.whl >/dev/null 2>&1 && [ ! -d "$CC_SITE/causal_conv1d" ]; then
    pip_into "$CC_SITE" .ccwheel/*.whl && echo "installed: causal-conv1d wheel ($(ls .ccwheel))"
  fi
  # the wheel of an earlier build is over a returned file's size: it comes back as its installed tree, packed
  if [ -f .ccwheel/ccsite.tgz ] && [ ! -d "$CC_SITE/causal_conv1d" ]; then
    mkdir -p "$CC_SITE" && tar xzf .ccwheel/ccsite.tgz -C "$CC_SITE" && echo "installed: causal-conv1d (packed tree)"
  fi
}

build_causal_conv1d() {   # from .ccsrc's sdist when no wheel came: build for this GPU, keep the wheel in $OUT
  [ -d "$CC_SITE/causal_conv1d" ] && return 0
  ls .ccsrc/*.tar.gz >/dev/null 2>&1 || return 0
  local arch; arch=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader | head -1)
  TORCH_CUDA_ARCH_LIST=$arch bash bench/build_causal_conv1d.sh .ccsrc/*.tar.gz /tmp/ccwheel \
    > "$O/causal_conv1d_build.log" 2>&1 \
    && pip_into "$CC_SITE" /tmp/ccwheel/*.whl && cp /tmp/ccwheel/*.whl "$O/" \
    && echo "built and installed causal-conv1d for sm_${arch/./}" \
    || { echo "causal-conv1d build failed: tail of $O/causal_conv1d_build.log:"; tail -20 "$O/causal_conv1d_build.log"; }
}

missing() {   # the modules a function needs that are not importable from /tmp/site yet
  $PY - "$@" <<'EOF'
import importlib.util, sys
print(" ".join(m for m in sys.argv[1:] if importlib.util.find_spec(m) is None))
EOF
}

need_or_say() {   # need_or_say MODULE...: 0 when all are importable, else says which are missing and fails
  local need; need=$(missing "$@")
  [ -z "$need" ] && return 0
  echo "installed what came with this call; still missing: $need (send the next group of carry folders now:" \
    "the machine keeps /tmp ~30 s)"
  return 1
}

# pytest_gpu LABEL SECONDS EXTRA_PYTHONPATH FILE...: GPU tests under a time limit, the log (and with JUNIT=1
# a junit report) in $O, the exit code appended to the log as a RESULT line
pytest_gpu() {
  local label=$1 secs=$2 extra=$3; shift 3
  PYTHONPATH=${extra:+$extra:}$PYTHONPATH timeout "$secs" $PY -m pytest -m gpu "$@" -v -s -ra -p no:cacheprovider \
    --timeout $((secs > 20 ? secs - 10 : 0)) ${JUNIT:+--junitxml="$O/suite_$label.xml"} > "$O/suite_$label.log" 2>&1
  echo "RESULT {\"suite\": \"$label\", \"exit\": $?}" >> "$O/suite_$label.log"
}

info() {
  nvidia-smi --query-gpu=index,name,memory.total,driver_version,compute_cap --format=csv
  $PY - <<'EOF'
import sys
sys.path.insert(0, ".")
from bench.gpu_common import versions, emit
emit({"versions": versions()})
EOF
  nproc; free -g | head -2; df -h /tmp | tail -1
}

# ---------------------------------------------------------------- "kernels": issue 16

# suite LABEL [EXTRA_PYTHONPATH]: the GPU test suite once, its log and a junit report in $OUT
suite() {
  echo "=== suite $1 ($(date +%T))"
  JUNIT=1 pytest_gpu "$1" "${SUITE_S:-420}" "${2:-}" tests/gpu
  grep -E "PASSED|FAILED|SKIPPED|ERROR|RESULT|^=+ .*(passed|failed|skipped|error)" "$O/suite_$1.log" | tail -80
}

# check_time LABEL [EXTRA_PYTHONPATH]: the start-up check alone in a fresh process (first run pays the JIT)
check_time() {
  local label=$1 extra=${2:-}
  for args in "--model qwen3.8-27b" "--model qwen3-4b --liger"; do
    PYTHONPATH=${extra:+$extra:}$PYTHONPATH timeout 150 $PY -m raytune_ft.models.kernel_check $args --repeat 2 \
      2>&1 | grep -E "RESULT|kernel check|kernels in use|Error" | sed "s/^/[$label] /"
  done
}

# kernels [nocc|cc|both]: the GPU suite without causal-conv1d, then with it (when a wheel came or was
# built), and the start-up check's time (a fresh process: the first of its two runs pays the JIT
# compiles). Send it with each group of carry folders; the runs start once Ray, mlflow, fla, tilelang,
# liger and pytest are all installed. One suite and its timing take up to ~7 minutes: with a 10-minute
# call, send "kernels nocc" and then "kernels cc" (both see /tmp's installs while the machine is warm).
kernels() {
  local which=${1:-both}
  install_present
  need_or_say ray mlflow fla tilelang z3 tvm_ffi liger_kernel trl pytest pytest_timeout || return 0
  if [ "$which" != nocc ]; then build_causal_conv1d; fi
  info > "$O/info.txt" 2>&1; cat "$O/info.txt"
  if [ "$which" != cc ]; then
    suite nocc
    check_time nocc | tee "$O/kernel_check_time_nocc.log"
  fi
  if [ "$which" != nocc ]; then
    if [ -d "$CC_SITE/causal_conv1d" ]; then
      PYTHONPATH=$CC_SITE:$PYTHONPATH $PY -c "import causal_conv1d; print('causal-conv1d', causal_conv1d.__version__)"
      suite cc "$CC_SITE"
      check_time cc "$CC_SITE" | tee "$O/kernel_check_time_cc.log"
    else
      echo "RESULT {\"suite\": \"cc\", \"exit\": \"skipped: no causal-conv1d wheel came (.ccwheel) and none was built (.ccsrc)\"}"
    fi
  fi
}

# ---------------------------------------------------------------- "fp8": issue 18 (float8 training)
# Carry .fp8whl (the torchao wheel + data/: the fixtures' chat rows) and .gputok (the Qwen3 tokenizer)
# with the install folders above; the runs start once torchao, fla, tilelang and its needs are installed.
# On two GPUs the throughput runs (GPU 0) and the loss parity + fp32-master runs (GPU 1) go side by side;
# on one GPU, `fp8` runs the throughput and `fp8 parity` the rest (a second call).
install_fp8() {
  if ls .fp8whl/*.whl >/dev/null 2>&1 && [ ! -f /tmp/site/.done_fp8whl ]; then
    pip_into /tmp/site .fp8whl/*.whl && touch /tmp/site/.done_fp8whl && echo "installed: torchao"
  fi
  if [ -d .fp8whl/data ] && [ ! -d /tmp/fp8data ]; then cp -r .fp8whl/data /tmp/fp8data; fi
  if [ -d .gputok/qwen3 ] && [ ! -d /tmp/tok/qwen3 ]; then
    mkdir -p /tmp/tok && cp -r .gputok/qwen3 /tmp/tok/ && cp .gputok/*.jinja /tmp/tok/ 2>/dev/null
  fi
  return 0
}

# The 27B cut at 32,768 tokens, compiled (train.compile), full checkpointing, one H200 each run. fp32
# master weights of the 16-layer cut (8.7B params x 16 B of weights, grads and AdamW states = 129 GiB)
# do not fit one H200 next to 32k activations: the 16-layer pairs use bf16 master weights, and the
# fp32-master pair the 8-layer cut.
F27="bench/gpu_compare.py --model qwen3.8-27b --seq 32768 --ac full --compile-mlp --steps 6 --warm 2"
fp8_speed() {
  run 270 27b16_bf16 $PY $F27 --layers 16 --master bf16
  run 270 27b16_fp8_tensorwise $PY $F27 --layers 16 --master bf16 --precision fp8 --fp8-recipe tensorwise
  run 270 27b16_fp8_rowwise $PY $F27 --layers 16 --master bf16 --precision fp8 --fp8-recipe rowwise
}
fp8_fp32master() {
  run 240 27b8_fp32master_bf16 $PY $F27 --layers 8 --master fp32
  run 240 27b8_fp32master_fp8_tensorwise $PY $F27 --layers 8 --master fp32 --precision fp8 --fp8-recipe tensorwise
}
fp8_loss_parity() {   # bf16, fp8 tensorwise, fp8 rowwise from the same weights; curves + figure in $O
  run 420 fp8_parity $PY bench/fp8_parity.py --tokenizer /tmp/tok/qwen3 --rows "/tmp/fp8data/*.jsonl" \
    --steps 300 --out "$O"
}
fp8_parity_then_fp32() { fp8_loss_parity; fp8_fp32master; }

fp8() {   # fp8 [speed|parity|all]: default all on two GPUs, speed on one
  local which=${1:-} n
  install_present
  install_fp8
  need_or_say torchao fla tilelang z3 tvm_ffi || return 0
  $PY -c "import torchao, torch; print('torchao', torchao.__version__, 'torch', torch.__version__)" 2>&1 | tail -1
  n=$(nvidia-smi -L | wc -l)
  info > "$O/info.txt" 2>&1; head -3 "$O/info.txt"
  if [ -z "$which" ] && [ "$n" -ge 2 ]; then which=all; fi
  case ${which:-speed} in
    speed)  on_gpus 0 fp8_speed fp8_speed ;;
    parity) on_gpus 0 fp8_parity fp8_parity_then_fp32 ;;
    all)    on_gpus 0 fp8_speed fp8_speed & on_gpus 1 fp8_parity fp8_parity_then_fp32 & wait ;;
  esac
  grep -h "RESULT\|Error\|error:" "$O"/fp8_*.log | cut -c1-1500
}

# fp8ray (two GPUs, optional): the 27B recipe itself through Ray Train on both GPUs, the 16-layer cut
# (a config folder), random weights, fp32 master weights, 32k blocks, compiled; bf16 then fp8 tensorwise.
# Needs Ray and mlflow too (.devpkgs, .gpuwheels) besides the fp8 call's folders.
RAY27="jobs/qwen27b_b300.py --no-register --set model.name=/tmp/m27b16 --set model.init=random
  --set model.revision=none --set model.tokenizer=/tmp/tok/qwen3
  --set model.chat_template=/tmp/tok/qwen3.8-27b.chat_template.jinja --set data.source=builtin:lognormal:800
  --set data.revision=none --set scaling.num_workers=2 --set scaling.gpus_per_node=2 --set train.max_steps=8
  --set train.log_every=2 --set train.checkpoint_every=1000 --set train.save_final=false
  --set registry.enabled=false --set tracking.storage_path=/tmp/runs"
fp8ray() {
  install_present
  install_fp8
  need_or_say ray mlflow torchao fla tilelang z3 tvm_ffi || return 0
  mkdir -p /tmp/runs
  $PY -c "from raytune_ft.models.tiny import real_config; real_config('qwen3.8-27b', num_hidden_layers=16).save_pretrained('/tmp/m27b16')"
  on_gpus 0,1 fp8ray_bf16 run 290 ray27b16_bf16 $PY $RAY27 --set tracking.run_name=ray27b16-bf16
  on_gpus 0,1 fp8ray_fp8 run 290 ray27b16_fp8 $PY $RAY27 --set train.precision=fp8 --set tracking.run_name=ray27b16-fp8
  grep -h "precision\|tok/s\|MFU\|Error\|OutOfMemory" "$O"/fp8ray_*.log | tail -30
}

on_gpus() {  # on_gpus DEVICES LOGNAME FUNC...: run a function on some GPUs, output to $O/LOGNAME.log
  local devs=$1 name=$2; shift 2
  ( export CUDA_VISIBLE_DEVICES=$devs; "$@" ) > "$O/$name.log" 2>&1
}

# ---------------------------------------------------------------- the third session's calls, both issues
# Two H200s; four calls sent back to back (bench/README.md): two that only install, then two that work.
# Call 3: GPU 0 measures bf16 vs float8 tensorwise (nothing else on that GPU); GPU 1 runs the GPU suite's
# kernel tests with causal-conv1d and without, then the start-up check's time. Call 4: the suite's FSDP2
# through Ray Train on both GPUs beside the loss parity on GPU 1; then float8 rowwise on GPU 0.
session_install() { install_present; install_fp8; }

session_ready() {
  need_or_say ray mlflow fla tilelang z3 tvm_ffi liger_kernel trl pytest pytest_timeout torchao || return 1
  [ -d "$CC_SITE/causal_conv1d" ] || echo "note: no causal-conv1d; its runs are skipped"
  info > "$O/info.txt" 2>&1; head -4 "$O/info.txt"
}

kernel_tests() {   # kernel_tests LABEL [EXTRA_PYTHONPATH]: the suite without its Ray Train part
  JUNIT=1 pytest_gpu "$1" "${SUITE_S:-280}" "${2:-}" tests/gpu/test_packed_equality.py tests/gpu/test_kernel_check_gpu.py
}

session_a() {
  session_install; session_ready || return 0
  fp8_pair() {
    run 280 27b16_bf16 $PY $F27 --layers 16 --master bf16
    run 280 27b16_fp8_tensorwise $PY $F27 --layers 16 --master bf16 --precision fp8 --fp8-recipe tensorwise
  }
  kernels_gpu1() {
    kernel_tests cc "$CC_SITE"
    SUITE_S=170 kernel_tests nocc
    check_time cc "$CC_SITE"; check_time nocc
  }
  on_gpus 0 fp8_speed fp8_pair & on_gpus 1 kernels_gpu1 kernels_gpu1 & wait
  grep -h "RESULT\|Error" "$O"/fp8_speed.log | cut -c1-1200
  grep -h -E "PASSED|FAILED|SKIPPED|ERROR|RESULT|passed|failed" "$O"/suite_*.log | cut -c1-400 | tail -80
  grep -h -E "RESULT|kernels in use|switched off" "$O"/kernels_gpu1.log | cut -c1-600 | tail -20
}

session_b() {   # as run in calls 7-8 (the Ray suite needs `cryptography` for mlflow's registry store: .gpuwheels)
  session_install; session_ready || return 0
  ray_suite() { JUNIT=1 pytest_gpu ray 400 "$CC_SITE" tests/gpu/test_fsdp_ray_gpu.py; }
  parity() {   # real rows + enough builtin rows that no block repeats within 300 steps
    run 480 fp8_parity $PY bench/fp8_parity.py --tokenizer /tmp/tok/qwen3 --rows "/tmp/fp8data/*.jsonl" \
      --builtin-rows 45000 --lr 1e-4 --steps 300 --recipes tensorwise --out "$O"
  }
  ray_suite & on_gpus 1 fp8_parity parity & wait
  grep -h -E "PASSED|FAILED|SKIPPED|ERROR|RESULT|passed|failed" "$O"/suite_ray.log | cut -c1-600 | tail -30
  grep -h "RESULT\|Error" "$O"/fp8_parity.log | cut -c1-1500
}

# run the named function when executed; only define them when sourced (bench/gpu_calls4.sh)
if [ "${BASH_SOURCE[0]}" = "$0" ]; then "$@"; fi
