#!/usr/bin/env bash
# Build a causal-conv1d wheel from its PyPI sdist on a GPU machine (nvcc + ninja + a CUDA torch), for the
# architectures of TORCH_CUDA_ARCH_LIST only (default 9.0, Hopper), then smoke-test it on the GPU.
#
#   bash bench/build_causal_conv1d.sh SDIST OUTDIR
#   PARTS=15M bash bench/build_causal_conv1d.sh SDIST OUTDIR   # the wheel as parts of <= 15 MiB instead
#                                                              # (bench/split_wheel.sh), to bring it back
#                                                              # through a transfer that caps a file's size
#
# Keep the built wheel (or its parts) in a wheelhouse folder: bench/install_wheelhouse.sh installs it on the
# next node of the same torch and CUDA, which then skips this build.
#
# Why a build of our own: causal-conv1d publishes wheels only on GitHub (not reachable from an offline GPU
# node), and its setup.py compiles for every architecture its CUDA knows (nine with CUDA 13), which takes
# far longer than one. The setup.py's fixed -gencode list is cut down to the requested architectures.
# Its setup.py also tries to download a prebuilt wheel first; CAUSAL_CONV1D_FORCE_BUILD skips that.
set -euo pipefail
sdist=${1:?usage: build_causal_conv1d.sh SDIST OUTDIR}; out=${2:?usage: build_causal_conv1d.sh SDIST OUTDIR}
archs=${TORCH_CUDA_ARCH_LIST:-9.0}
work=$(mktemp -d)
tar xzf "$sdist" -C "$work"
src=$(echo "$work"/causal_conv1d-*)
python3 - "$src/setup.py" "$archs" <<'EOF'
import re, sys
path, archs = sys.argv[1], sys.argv[2]
keep = {a.replace(".", "") for a in archs.replace(";", " ").split()}
text = open(path).read()
text = re.sub(r'cc_flag\.append\("-gencode"\)', "pass", text)
def arch(m):
    return (f'cc_flag += ["-gencode", "{m.group(1)}"] if "{m.group(2)}" in {sorted(keep)!r} else []')
text = re.sub(r'cc_flag\.append\("(arch=compute_(\d+),code=sm_\d+)"\)', arch, text)
open(path, "w").write(text)
print("gencode kept for:", sorted(keep))
EOF
mkdir -p "$out"
start=$(date +%s)
(cd "$src" && CAUSAL_CONV1D_FORCE_BUILD=TRUE MAX_JOBS=${MAX_JOBS:-16} TORCH_CUDA_ARCH_LIST="$archs" \
  python3 -m pip wheel -q --no-build-isolation --no-deps -w "$out" .)
echo "built in $(( $(date +%s) - start )) s: $(ls "$out")"
if [[ -n ${PARTS:-} ]]; then
  for w in "$out"/causal_conv1d-*.whl; do
    bash "$(dirname "$0")/split_wheel.sh" "$w" "$out" "$PARTS" && rm -f "$w"
  done
fi
