"""A recipe run's figures read back from its MLflow store: the logged windows, and tokens/s, MFU and peak memory
over the windows after the first. Used by the kit (gpu_kit.py) and its LoRA part (gpu_lora.py), which import
it, not each other."""
from __future__ import annotations


def metric_windows(summary: dict, names=("tokens_per_s", "tokens_per_s_per_worker", "mfu", "mfu_measured_matmul",
                                        "peak_mem_gib", "loss")) -> dict:
    """Each logged window's metrics from the run's MLflow store, by step."""
    import mlflow

    from raytune_ft.tracking.mlflow_run import mlflow_metric_name

    client = mlflow.MlflowClient(summary["tracking_uri"])
    out = {}
    for name in names:
        hist = sorted(client.get_metric_history(summary["mlflow_run_id"], mlflow_metric_name(name)),
                      key=lambda m: m.step)
        by_step = {}
        for m in hist:
            by_step[m.step] = m.value   # the final report repeats the last window's step: keep one
        out[name] = by_step
    return out


def throughput_figures(summary: dict) -> dict:
    """tokens/s, per GPU, MFU and peak memory over the windows after the first (which holds the compiles and
    the kernels' JIT), and the loss at the last step."""
    w = metric_windows(summary)
    steps = sorted(w["tokens_per_s"])
    timed = steps[1:] or steps
    mean = (lambda name: sum(w[name][s] for s in timed if s in w[name]) / max(1, sum(s in w[name] for s in timed))
            if w[name] else None)
    fig = {"steps": summary.get("steps"), "timed_windows_end_at_step": timed,
           "tok_s_windows": [round(w["tokens_per_s"][s]) for s in timed],
           "tok_s": round(mean("tokens_per_s") or 0), "tok_s_per_gpu": round(mean("tokens_per_s_per_worker") or 0),
           "final_loss": summary.get("final_loss")}
    if w["mfu"]:
        fig["mfu"] = round(mean("mfu"), 4)
    if w["mfu_measured_matmul"]:
        fig["mfu_measured_matmul"] = round(mean("mfu_measured_matmul"), 4)
    if w["peak_mem_gib"]:
        fig["peak_gib"] = round(max(w["peak_mem_gib"].values()), 1)
    return fig
