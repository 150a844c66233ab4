#!/usr/bin/env bash
# Split a wheel into parts of at most SIZE (`split -b`'s form: 15M, 512K), for a transfer that caps each file's
# size (a built causal-conv1d wheel is ~26 MB); bench/install_wheelhouse.sh puts the parts back together, checks
# them against the checksum written here, and installs the whole wheel with the folder's others.
#
#   bash bench/split_wheel.sh WHEEL OUTDIR [SIZE]     # OUTDIR/<wheel>.part-00, -01, ... and <wheel>.sha256
set -euo pipefail
wheel=${1:?usage: split_wheel.sh WHEEL OUTDIR [SIZE]}; out=${2:?usage: split_wheel.sh WHEEL OUTDIR [SIZE]}
size=${3:-15M}
[[ -f $wheel && $wheel == *.whl ]] || { echo "not a wheel file: $wheel" >&2; exit 2; }
mkdir -p "$out"
name=$(basename "$wheel")
rm -f "$out/$name".part-*
split -b "$size" -d -a 2 "$wheel" "$out/$name.part-"
(cd "$(dirname "$wheel")" && sha256sum "$name") > "$out/$name.sha256"
echo "split: $name into $(ls "$out/$name".part-* | wc -l) parts of at most $size in $out"
