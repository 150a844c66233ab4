# Shared by bench/gpu_calls*.sh (sourced): the environment of every device run and `run`, which runs one
# process under its own time limit so a crash or OOM never takes the call's other runs with it.
export PYTHONUNBUFFERED=1 PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
export PYTHONPATH=/tmp/site:${PWD}${PYTHONPATH:+:$PYTHONPATH}
PY=python3

run() {  # run SECONDS LABEL CMD...
  local secs=$1 label=$2; shift 2
  echo "=== $label: $* ($(date +%T))"
  timeout "$secs" "$@" 2>&1 | grep -v -E "FutureWarning|warnings.warn|UserWarning: .*(deprecated|TF32)" \
    || echo "RESULT {\"label\": \"$label\", \"exit\": \"failed or timed out ($secs s)\"}"
  echo "=== $label done ($(date +%T))"
}
