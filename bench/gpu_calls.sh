#!/usr/bin/env bash
# The device calls of the GPU benchmark session, one function per call (see bench/README.md).
# Run on the device machine from the repository root:  bash bench/gpu_calls.sh call1   (etc.)
# Each run is one process (one config), bounded by `timeout`, so one crash or OOM never takes the
# call's other runs with it. Output: the caller tees stdout into $OUT/log; RESULT lines are the data.
set -u -o pipefail
source "$(dirname "$0")/gpu_lib.sh"

install_base() {  # the project's extra wheels (trl, datasets, liger, fla, ...), without Ray
  mkdir -p /tmp/site && $PY -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .devpkgs/wheels/*.whl
}

install_tilelang_1() {  # tilelang itself (50 MB) into /tmp/site; its needs come in the next call
  $PY -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .tl1/*.whl
}

install_tilelang_2() {
  $PY -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .tl2/*.whl
}

info() {
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.max.sm --format=csv
  $PY - <<'EOF'
import sys
sys.path.insert(0, ".")
from bench.gpu_common import versions, emit
emit({"versions": versions()})
EOF
}

# Call 1: Qwen3-4B full fine-tune (no gated-delta-net layers: needs no tilelang). The project's loop in
# its modes vs TRL bfd + padding-free + Liger, one process each.
call1() {
  install_base && install_tilelang_1 || { echo "install failed"; return 1; }
  info
  local C="$PY bench/gpu_compare.py --model qwen3-4b --steps 8 --warm 3"
  run 150 4b_fp32_full_16k $C --seq 16384 --ac full --master fp32
  run 150 4b_bf16_full_16k $C --seq 16384 --ac full --master bf16
  run 150 4b_bf16_sel_16k $C --seq 16384 --ac selective --master bf16
  run 150 4b_bf16_none_16k $C --seq 16384 --ac none --master bf16
  run 150 4b_fp32_sel_16k $C --seq 16384 --ac selective --master fp32
  run 120 4b_fp32_full_8k $C --seq 8192 --ac full --master fp32
  STEPS=12 run 200 trl_best_liger $PY .peers/peer_trl.py trl_best_liger
}

# Call 2: tilelang's needs, then the packed-vs-separate equality (issue 4) and the 27B cut at 16 layers:
# the seed loop as written vs the project's loop (issue 7).
call2() {
  install_tilelang_2 || { echo "install failed"; return 1; }
  $PY -c "import tilelang, fla; print('tilelang', tilelang.__version__, 'fla', fla.__version__)"
  run 420 equality $PY bench/packed_equality_gpu.py
  NL=16 SEQ=16384 STEPS=7 run 150 seed_16l_16k $PY .peers/seed000_loop.py sdpa
  local C="$PY bench/gpu_compare.py --model qwen3.8-27b --layers 16 --steps 7 --warm 3"
  run 130 27b16_full_16k $C --seq 16384 --ac full
  run 130 27b16_sel_16k $C --seq 16384 --ac selective
  run 150 27b16_full_32k $C --seq 32768 --ac full --steps 6 --warm 2
}

# Call 3: what call 2 could not hold: 32k selective, no checkpointing at 16k, the compiled-MLP variant.
call3() {
  local C="$PY bench/gpu_compare.py --model qwen3.8-27b --layers 16 --steps 7 --warm 3"
  run 150 27b16_sel_32k $C --seq 32768 --ac selective --steps 6 --warm 2
  run 130 27b16_none_16k $C --seq 16384 --ac none
  run 200 27b16_full_16k_compile $C --seq 16384 --ac full --compile-mlp
}

"$@"
