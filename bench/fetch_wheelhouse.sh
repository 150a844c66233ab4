#!/usr/bin/env bash
# Build a wheelhouse for an air-gapped GPU node, on a machine that can reach PyPI: the packages the
# project's GPU runs and the GPU test suite need beyond a PyTorch image (torch, transformers, peft,
# accelerate, pyarrow, pandas, numpy present), as wheels for CPython 3.12 on x86-64 Linux, plus Ray as
# a trimmed tarball (its Java jars, RLlib and the dashboard's web build left out: ~30 MB, not 79; the job
# server runs without the web pages).
# bench/install_wheelhouse.sh installs them on the node.
#
#   bash bench/fetch_wheelhouse.sh DIR                 # everything in DIR
#   bash bench/fetch_wheelhouse.sh DIR --max-mib 60    # split into DIR-1, DIR-2, ... of at most 60 MiB
#                                                      # each (for media or transfers with a size cap)
set -euo pipefail
dir=${1:?usage: fetch_wheelhouse.sh DIR [--max-mib N]}; shift
max_mib=0
if [[ ${1:-} == --max-mib ]]; then max_mib=${2:?--max-mib N}; fi
PY=${PY:-python3}

plat=(--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64
      --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
get() {   # get DIR [--no-deps] REQ...: binary wheels for the node's Python and platform
  local d=$1; shift
  $PY -m pip download -q --only-binary=:all: --python-version 3.12 --implementation cp --abi cp312 \
    --abi abi3 --abi none "${plat[@]}" --platform any -d "$d" "$@"
}

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
mkdir -p "$work/all"

# Named one by one (no dependency resolution): their requirements name torch and transformers, which the
# node already has; fsspec is pinned because datasets 5.2 refuses newer ones.
get "$work/all" --no-deps trl==1.16.0 datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19 'fsspec<=2026.9.0' \
  xxhash liger-kernel==0.8.5 flash-linear-attention==0.6.0 fla-core==0.6.0 torchao==0.18.0 \
  tilelang==0.1.15 'z3-solver<4.15.5' 'apache-tvm-ffi<0.1.13' torch-c-dlpack-ext ml-dtypes cloudpickle \
  jsonschema jsonschema-specifications referencing rpds-py tensorboardX 'pydantic>=2.5,<3' pydantic-core \
  typing-inspection annotated-types
# Resolved with their needs (nothing here asks for torch): MLflow's client and its sqlite store
# (sqlalchemy, alembic), the registry store's cryptography, pytest for the GPU suite, and what Ray's
# dashboard needs to serve `ray job submit` (ray[default]'s extras; resolved together with MLflow's so that
# both get one set of opentelemetry packages).
get "$work/all" mlflow-skinny==3.17.2 sqlalchemy alembic cryptography pytest pytest-timeout \
  aiohttp aiohttp-cors colorful smart-open opencensus opentelemetry-exporter-prometheus prometheus-client \
  virtualenv py-spy grpcio

# what a PyTorch image with transformers already holds: left out so the node keeps its own builds
have='^(torch|triton|nvidia_.*|transformers|tokenizers|huggingface_hub|hf_xet|safetensors|numpy|pyarrow|pandas|peft|accelerate|filelock|typing_extensions|sympy|mpmath|networkx|jinja2|markupsafe|pyyaml|regex|requests|urllib3|idna|certifi|charset_normalizer|tqdm|packaging|psutil|python_dateutil|pytz|tzdata|six|setuptools|protobuf)-'
for w in "$work"/all/*.whl; do
  name=$(basename "$w" | tr 'A-Z' 'a-z')
  if [[ $name =~ $have ]]; then rm -f "$w"; fi
done
# pynvml, for MLflow's GPU system metrics (tracking.system_metrics): after the filter, which takes nvidia_* for
# CUDA's own wheels
get "$work/all" --no-deps nvidia-ml-py

if [[ ! -f $work/all/ray.tar.xz ]]; then
  get "$work/ray" --no-deps ray==2.60.0
  mkdir "$work/ray/u" && (cd "$work/ray/u" && $PY -m zipfile -e "$work"/ray/ray-*.whl .)
  rm -rf "$work/ray/u/ray/jars" "$work/ray/u/ray/rllib" "$work/ray/u/ray/dashboard/client/build"
  tar cf - -C "$work/ray/u" . | xz -T0 -6 > "$work/all/ray.tar.xz"
fi

if [[ $max_mib -le 0 ]]; then
  mkdir -p "$dir" && mv "$work"/all/* "$dir"/
  du -sh "$dir"
  exit 0
fi
# first fit, largest file first: each part stays under the cap
$PY - "$work/all" "$dir" "$max_mib" <<'EOF'
import os, shutil, sys
src, dst, cap = sys.argv[1], sys.argv[2], int(sys.argv[3]) * 2**20
files = sorted(os.listdir(src), key=lambda f: -os.path.getsize(os.path.join(src, f)))
parts: list[list] = []
for f in files:
    size = os.path.getsize(os.path.join(src, f))
    if size > cap:
        sys.exit(f"{f} is {size / 2**20:.1f} MiB, over the {cap // 2**20} MiB cap")
    part = next((p for p in parts if p[0] + size <= cap), None)
    if part is None:
        part = [0, []]
        parts.append(part)
    part[0] += size
    part[1].append(f)
for i, (size, names) in enumerate(parts, 1):
    out = f"{dst}-{i}"
    os.makedirs(out, exist_ok=True)
    for f in names:
        shutil.move(os.path.join(src, f), os.path.join(out, f))
    print(f"{out}: {size / 2**20:.1f} MiB, {len(names)} files")
EOF
