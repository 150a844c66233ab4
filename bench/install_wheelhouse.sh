#!/usr/bin/env bash
# Install from a wheelhouse: on an air-gapped GPU node, install the packages of one or more wheel folders
# (made by bench/fetch_wheelhouse.sh on a machine with PyPI access) with pip, offline, plus Ray from
# ray.tar.xz when a folder holds it.
#
#   bash bench/install_wheelhouse.sh DIR...                       # into this Python's environment, with
#                                                                 # pip's dependency check
#   bash bench/install_wheelhouse.sh --target /opt/site DIR...    # into a folder of its own (no dependency
#                                                                 # check); then export PYTHONPATH=/opt/site:$PWD
#
# With --target (or --no-deps) each folder installs on its own, in any order, so the folders may arrive
# one at a time. Without it, pip resolves every requirement from the folders and the environment, so name
# all the folders at once.
set -euo pipefail
PY=${PY:-python3}
target=""
deps=1
while [[ $# -gt 0 && $1 == --* ]]; do
  case $1 in
    --target) target=${2:?--target DIR}; shift 2; deps=0 ;;
    --no-deps) deps=0; shift ;;
    *) echo "unknown option $1" >&2; exit 2 ;;
  esac
done
[[ $# -gt 0 ]] || { echo "usage: install_wheelhouse.sh [--target DIR] [--no-deps] WHEEL_DIR..." >&2; exit 2; }

if [[ -n $target ]]; then
  mkdir -p "$target"
  site=$target
else
  site=$($PY -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
fi

links=()
wheels=()
joined=$(mktemp -d)
trap 'rm -rf "$joined"' EXIT
links+=(--find-links "$joined")
for d in "$@"; do
  [[ -d $d ]] || { echo "not a folder: $d" >&2; exit 2; }
  links+=(--find-links "$d")
  for w in "$d"/*.whl; do [[ -e $w ]] && wheels+=("$w"); done
  # a wheel split by bench/split_wheel.sh (<wheel>.part-00, -01, ... and <wheel>.sha256): put back together and
  # checked against its checksum before it is installed
  for first in "$d"/*.whl.part-00; do
    [[ -e $first ]] || continue
    name=$(basename "${first%.part-00}")
    [[ -f $d/$name.sha256 ]] || { echo "$d/$name: parts without $name.sha256 (bench/split_wheel.sh writes it)" >&2; exit 2; }
    cat "$d/$name".part-* > "$joined/$name"
    (cd "$joined" && sha256sum --quiet -c) < "$d/$name.sha256" 2>/dev/null || {
      echo "$d/$name: the joined parts do not match $name.sha256 (a part missing or cut short)" >&2; exit 2; }
    wheels+=("$joined/$name")
    echo "joined: $name from $(ls "$d/$name".part-* | wc -l) parts"
  done
  if [[ -f $d/ray.tar.xz ]]; then
    # Ray's wheel without its jars, RLlib and web build: unpacked as pip would lay it out; the two
    # daemons lose their exec bit in the tarball's round trip
    tar xJf "$d/ray.tar.xz" -C "$site"
    chmod +x "$site/ray/core/src/ray/raylet/raylet" "$site/ray/core/src/ray/gcs/gcs_server"
    # the dashboard (and with it the job server `ray job submit` talks to) refuses to start without a web
    # build folder: an empty page stands in for the pages left out
    mkdir -p "$site/ray/dashboard/client/build/static"
    [[ -f $site/ray/dashboard/client/build/index.html ]] || \
      echo '<html><body>Ray dashboard pages not installed (bench/install_wheelhouse.sh)</body></html>' \
        > "$site/ray/dashboard/client/build/index.html"
    echo "installed: Ray (from $d/ray.tar.xz) into $site"
  fi
done

if [[ ${#wheels[@]} -gt 0 ]]; then
  args=(-q --no-index --no-compile "${links[@]}")
  [[ $deps == 1 ]] || args+=(--no-deps)
  if [[ -z $target ]]; then
    $PY -m pip install "${args[@]}" "${wheels[@]}"
  else
    # pip's --target --upgrade replaces a top-level folder whole: a namespace package split over two
    # wheelhouses (opentelemetry, google) would lose the first one's half. Installed apart, then merged
    fresh=$(mktemp -d "$target/.install.XXXXXX")
    $PY -m pip install "${args[@]}" --target "$fresh" "${wheels[@]}"
    cp -a "$fresh"/. "$target"/
    rm -rf "$fresh"
  fi
  echo "installed: ${#wheels[@]} wheels from $* into $site"
fi
[[ -z $target ]] || echo "now: export PYTHONPATH=$target:\$PWD"
