#!/usr/bin/env bash
# The device calls of the second GPU session (nvidia-h200-x2: two H200s of one host), one function per
# call. Run on the device machine from the repository root:  bash bench/gpu_calls2.sh trl   (etc.)
#
# Carried per call (git-ignored folders; see bench/README.md for how each is made):
#   trl:      .devpkgs (Ray + trl/datasets/liger/fla wheels), .gpuwheels (mlflow-skinny and its needs),
#             .gputok (the real Qwen tokenizer files from ../shared/fixtures), .peers (../shared/peers)
#   multi:    .tl1 (tilelang: fla's gated-delta-net backward on Hopper with Triton 3.6), .peers
#   gdn:      .tl2 (tilelang's needs), .peers
# Each run is one process with its own `timeout`, so a crash or OOM never takes the call's other runs
# with it. Runs on different GPUs go in parallel (CUDA_VISIBLE_DEVICES); each Ray job starts its own
# local Ray on the GPUs it sees. RESULT lines (bench) and the jobs' summary.json files are the data.
set -u -o pipefail
source "$(dirname "$0")/gpu_lib.sh"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1 RAY_COLOR_PREFIX=0
export TOKENIZERS_PARALLELISM=false
O=${OUT:-/tmp/out}
mkdir -p "$O"

on_gpus() {  # on_gpus DEVICES LOGNAME FUNC...: run a function on some GPUs, output to $O/LOGNAME.log
  local devs=$1 name=$2; shift 2
  ( export CUDA_VISIBLE_DEVICES=$devs; "$@" ) > "$O/$name.log" 2>&1
}

summaries() {  # keep each job's summary.json (one small file back, not a folder per run)
  for f in /tmp/runs/*/summary.json; do
    [ -f "$f" ] && { echo "--- $f"; cat "$f"; echo; }
  done > "$O/summaries.txt" 2>/dev/null || true
}

info() {
  nvidia-smi --query-gpu=index,name,memory.total,driver_version,clocks.max.sm --format=csv
  $PY - <<'EOF'
import sys
sys.path.insert(0, ".")
from bench.gpu_common import versions, emit
emit({"versions": versions()})
EOF
  nproc; free -g | head -2; df -h /tmp | tail -1
}

install_ray() {   # the Ray tarball of .devpkgs into /tmp/site
  mkdir -p /tmp/site && tar xJf .devpkgs/ray.tar.xz -C /tmp/site \
    && chmod +x /tmp/site/ray/core/src/ray/raylet/raylet /tmp/site/ray/core/src/ray/gcs/gcs_server
}

install_tokenizers() {   # .gputok -> /tmp/tok (qwen2-0.5b shares qwen3's vocab and merges)
  mkdir -p /tmp/tok/qwen2-0.5b /tmp/runs && cp -r .gputok/qwen3 /tmp/tok/ && cp .gputok/*.jinja /tmp/tok/ \
    && cp .gputok/qwen2-0.5b/* /tmp/tok/qwen2-0.5b/ \
    && cp .gputok/qwen3/vocab.json .gputok/qwen3/merges.txt /tmp/tok/qwen2-0.5b/
}

install_trl() {
  install_ray \
    && $PY -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .devpkgs/wheels/*.whl \
       .gpuwheels/*.whl \
    && install_tokenizers
}

# ---------------------------------------------------------------- call "trl": issues 5, 7 (4B), 10
# Real shapes, random weights (model.init=random), builtin:lognormal data (the peers' lengths).
TRL4B="jobs/qwen3_4b_full.py --set model.init=random --set model.tokenizer=/tmp/tok/qwen3
  --set data.source=builtin:lognormal:1500 --set tracking.storage_path=/tmp/runs"
LORA="jobs/qwen2_05b_lora.py --set model.init=random --set model.tokenizer=/tmp/tok/qwen2-0.5b
  --set data.source=builtin:lognormal:3600 --set data.validation_split=none --set data.validation_fraction=0.05
  --set train.max_steps=12 --set train.warmup_steps=3 --set train.eval_every=6 --set train.checkpoint_every=6
  --set train.log_every=3
  --set tracking.storage_path=/tmp/runs"

gpu_trl4b() {   # the Qwen3-4B TRL recipe with Liger (issue 5), then without (issue 7: vs TRL as configured)
  run 330 trl4b_liger $PY $TRL4B --no-register --set train.use_liger=true --set train.max_steps=16 \
    --set train.eval_every=8 --set train.checkpoint_every=8 --set train.log_every=4 \
    --set tracking.run_name=trl4b-liger
  run 150 trl4b_plain $PY $TRL4B --no-register --set train.use_liger=false --set train.max_steps=10 \
    --set train.eval_every=null --set train.load_best_at_end=false --set train.checkpoint_every=100 \
    --set train.log_every=5 --set tracking.run_name=trl4b-plain
}
gpu_lora1_peer() {   # the LoRA recipe on one GPU, then TRL as the 4B recipe configures it (the peer row)
  run 300 lora_1gpu $PY $LORA --set scaling.num_workers=1 --set scaling.gpus_per_node=1 \
    --set tracking.run_name=lora-1gpu --set registry.name=main.default.qwen2_05b_lora_1gpu
  STEPS=12 run 180 peer_seed003 $PY .peers/peer_trl.py seed003
}

trl() {   # issue 5 (both TRL recipes at real shape, Liger), issue 7 (TRL recipe vs TRL as configured)
  install_trl || { echo "install failed"; return 1; }
  info
  on_gpus 0 gpu0 gpu_trl4b &
  on_gpus 1 gpu1 gpu_lora1_peer &
  wait
  summaries
  grep -h "RESULT\|tok/s\|Liger\|registered\|Error" "$O"/gpu*.log | tail -60
}

# ---------------------------------------------------------------- call "multi": issue 10, issue 7 (4B)
# tilelang rides along (the next call's gated-delta-net backward needs it); then the LoRA recipe on all
# GPUs of the machine, then the FSDP2 loop's 4B figure and TRL's best in parallel on GPU 0 and 1.
peer_best() { STEPS=12 run 200 trl_best_liger $PY .peers/peer_trl.py trl_best_liger; }

# ---------------------------------------------------------------- calls "prep", "gdn", "trl2" (fresh machine)
# prep (carry .tl1 .gpuB): tilelang + the project's extra wheels (fla, trl, datasets, liger, ...)
prep() {
  mkdir -p /tmp/site && $PY -m pip install -q --no-index --no-deps --no-compile --target /tmp/site \
    .tl1/*.whl .gpuB/*.whl && echo installed
}

C27="bench/gpu_compare.py --model qwen3.8-27b --layers 16 --steps 7 --warm 3"
gpu_seed() { NL=16 SEQ=16384 STEPS=7 run 200 seed_16l_16k $PY .peers/seed000_loop.py sdpa; }
gpu_ours16() { run 240 27b16_16k_compile $PY $C27 --seq 16384 --ac full --compile-mlp; }
gpu_ours16_old() { run 240 27b16_16k_compile_padded_repeat $PY $C27 --seq 16384 --ac full --compile-mlp \
  --conv padded --gqa repeat; }
gpu_ours32() { run 200 27b16_32k_compile $PY $C27 --seq 32768 --ac full --compile-mlp --steps 6 --warm 2; }
gpu_seed_then_ours() { gpu_seed; gpu_ours16; }
gpu_old_then_32k() { gpu_ours16_old; gpu_ours32; }

# gdn (carry .tl2 .gpuwheels .gputok .peers): tilelang's needs, mlflow, tokenizers; then the 27B cut on two
# GPUs: the seed then ours (new conv + native GQA) on GPU 0; ours in the previous form then ours at 32k on GPU 1
gdn() {
  $PY -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .tl2/*.whl .gpuwheels/*.whl \
    || { echo "install failed"; return 1; }
  install_tokenizers
  $PY -c "import tilelang, fla; print('tilelang', tilelang.__version__, 'fla', fla.__version__)"
  on_gpus 0 gdn0 gpu_seed_then_ours &
  on_gpus 1 gdn1 gpu_old_then_32k &
  wait
  grep -h "RESULT" "$O"/gdn*.log
}

# trl2 (carry .devpkgs): Ray; the LoRA recipe on both GPUs (issue 10); then the 4B TRL recipe (issue 5,
# built on the GPU now) on GPU 0 while GPU 1 runs the FSDP2 loop's 4B figure and TRL's best (issue 7)
gpu_trl4b_only() {
  run 300 trl4b_liger $PY $TRL4B --no-register --set train.max_steps=12 \
    --set train.eval_every=6 --set train.checkpoint_every=6 --set train.log_every=3 \
    --set tracking.run_name=trl4b-liger
}
gpu_4b_pair() {
  run 170 4b_bf16_sel_16k_compile $PY bench/gpu_compare.py --model qwen3-4b --steps 8 --warm 3 \
    --seq 16384 --ac selective --master bf16 --compile-mlp
  peer_best
}
trl2() {
  install_ray || { echo "install failed"; return 1; }
  info
  local n; n=$(nvidia-smi -L | wc -l)
  on_gpus "$(seq -s, 0 $((n - 1)))" lora_multi run 220 lora_${n}gpu $PY $LORA --set scaling.num_workers=$n \
    --set scaling.gpus_per_node=$n --set tracking.run_name=lora-${n}gpu \
    --set registry.name=main.default.qwen2_05b_lora_${n}gpu
  on_gpus 0 trl4b gpu_trl4b_only &
  on_gpus 1 b4 gpu_4b_pair &
  wait
  summaries
  grep -h "RESULT\|tok/s\|registered\|Error" "$O"/lora_multi.log "$O"/trl4b.log "$O"/b4.log | tail -50
}

# The 27B recipe at its real shape (64 layers, random weights) through Ray Train on the 4 GPUs: bf16
# parameters (the fp32-master mode needs 8 GPUs), 32k blocks, no final checkpoint (162 GB of DCP state
# and a 54 GB export would not fit this machine's disk and call).
real27b() {
  on_gpus 0,1,2,3 real27b run ${1:-420} real27b_4gpu $PY jobs/qwen27b_b300.py --no-register \
    --set model.init=random --set model.tokenizer=/tmp/tok/qwen3 \
    --set model.chat_template=/tmp/tok/qwen3.8-27b.chat_template.jinja \
    --set data.source=builtin:lognormal:2000 --set data.revision=none \
    --set scaling.num_workers=4 --set scaling.gpus_per_node=4 --set train.master_weights=bf16 \
    --set train.max_steps=${2:-8} --set train.log_every=2 --set train.checkpoint_every=1000 \
    --set train.save_final=false --set registry.enabled=false \
    --set tracking.storage_path=/tmp/runs --set tracking.run_name=real27b-4gpu
  summaries
  grep -h "tok/s\|MFU\|Error\|error\|OutOfMemory" "$O"/real27b.log | tail -30
}

"$@"
