#!/usr/bin/env bash
# A headless-browser screenshot of the MLflow run page of `make local` (its charts tab), the curves a user
# sees first. Needs chromium (Debian: apt-get install -y chromium) and the project's venv.
#
#   bench/mlflow_screenshot.sh [STORAGE] [OUT.png]
#
# STORAGE: the tracking.storage_path of a finished --local run of jobs/qwen27b_b300.py; when it is not
# given, the run is made first in a temporary folder. OUT defaults to bench/mlflow_run_page.png.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
OUT=$(realpath -m "${2:-bench/mlflow_run_page.png}")    # chromium writes a relative path nowhere
PORT=${PORT:-5057}
WORK=$(mktemp -d)
SERVER=""
cleanup() {
    [ -n "$SERVER" ] && kill "$SERVER" 2>/dev/null || true
    rm -rf "$WORK"
}
trap cleanup EXIT

STORAGE=${1:-}
if [ -z "$STORAGE" ]; then
    STORAGE="$WORK/runs"
    "$PY" jobs/qwen27b_b300.py --local --set "tracking.storage_path=$STORAGE" > "$WORK/run.log" 2>&1 \
        || { tail -40 "$WORK/run.log"; exit 1; }
fi

# the store, experiment and run the summary names
read -r STORE URL_PATH < <("$PY" - "$STORAGE/qwen27b-local/summary.json" <<'EOF'
import json, sys
from mlflow import MlflowClient
s = json.load(open(sys.argv[1]))
run = MlflowClient(s["tracking_uri"]).get_run(s["mlflow_run_id"])
print(s["tracking_uri"], f"#/experiments/{run.info.experiment_id}/runs/{run.info.run_id}/model-metrics")
EOF
)

.venv/bin/mlflow ui --backend-store-uri "$STORE" --host 127.0.0.1 --port "$PORT" > "$WORK/ui.log" 2>&1 &
SERVER=$!
for _ in $(seq 60); do
    curl -fs "http://127.0.0.1:$PORT/health" > /dev/null 2>&1 && break
    sleep 1
done

chromium --headless --no-sandbox --disable-gpu --disable-background-networking --window-size=1400,1000 \
    --virtual-time-budget=20000 --user-data-dir="$WORK/chromium" --screenshot="$OUT" \
    "http://127.0.0.1:$PORT/$URL_PATH" 2> "$WORK/chromium.log" || { tail -20 "$WORK/chromium.log"; exit 1; }
echo "$OUT: http://127.0.0.1:$PORT/$URL_PATH"
