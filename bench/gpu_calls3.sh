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
#   .gpuwheels   mlflow-skinny and its needs not in the image                                 ~15 MB
#   .devpkgs     Ray (trimmed tarball) + trl/datasets/liger/fla wheels                        ~36 MB
#   .pytestwheels  pytest, pytest-timeout and their needs                                     ~2 MB
#   .ccwheel     a causal-conv1d wheel built for this GPU (optional; bench/build_causal_conv1d.sh)
#   .ccsrc       causal-conv1d's sdist, built here when no wheel came (optional; takes minutes)
# Logs and RESULT lines go to $OUT.
set -u -o pipefail
source "$(dirname "$0")/gpu_lib.sh"
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
  local label=$1 extra=${2:-} rc
  echo "=== suite $label ($(date +%T))"
  PYTHONPATH=${extra:+$extra:}$PYTHONPATH timeout ${SUITE_S:-420} $PY -m pytest -m gpu tests/gpu -v -s \
    -p no:cacheprovider --timeout 400 --junitxml="$O/suite_$label.xml" > "$O/suite_$label.log" 2>&1
  rc=$?
  grep -E "^(tests/gpu/.*(PASSED|FAILED|SKIPPED|ERROR)|RESULT|=+ .*(passed|failed|skipped|error).* =+$)" \
    "$O/suite_$label.log" | tail -60
  echo "RESULT {\"suite\": \"$label\", \"exit\": $rc}"
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
  local which=${1:-both} need
  install_present
  need=$(missing ray mlflow fla tilelang z3 tvm_ffi liger_kernel trl pytest pytest_timeout)
  if [ -n "$need" ]; then
    echo "installed what came with this call; still missing: $need (send the next call now: the machine keeps /tmp ~30 s)"
    return 0
  fi
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

"$@"
