"""End-of-run figures: the loss curve (train and eval) and the throughput curve, as PNG files and as
artifacts of the run's MLflow run.

Where the numbers come from (`run_history`):
  train loss   the per-step `history` the FSDP2 loop keeps in the final checkpoint
               (train_state/rank0.json), or the TRL loop's trainer_state.json log_history;
  eval loss    `eval_history` in train_state, the `eval_loss` entries of log_history, or the MLflow
               metric `eval_loss`;
  throughput   `tokens_per_s` in the history entries when a loop stores it, else the MLflow metric
               `tokens_per_s` that rank 0 logs once per logging window.
Figures are drawn with matplotlib's Agg canvas directly (no pyplot, no display, no global state).
"""
from __future__ import annotations

import json
import os
from typing import Iterable

LOSS_PNG = "loss.png"
THROUGHPUT_PNG = "throughput.png"


def _figure(width: float = 8.0, height: float = 4.5):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), dpi=110, layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def _moving_average(values: list[float], window: int) -> list[float]:
    out, acc = [], 0.0
    for i, v in enumerate(values):
        acc += v
        if i >= window:
            acc -= values[i - window]
        out.append(acc / min(i + 1, window))
    return out


def _finite(points: Iterable[tuple[float, float]]) -> list[tuple[float, float]]:
    return [(x, y) for x, y in points if y is not None and y == y and abs(y) != float("inf")]


def _finish(fig, ax, ylabel: str, title: str, path: str) -> str:
    """Step axis, labels, grid and legend shared by both plots; save and return the path."""
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("optimizer step")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.savefig(path)
    return path


def write_run_plots(history: list[dict], eval_history: list[dict], out_dir: str, *,
                    title: str | None = None, checkpoint_steps: Iterable[int] = ()) -> list[str]:
    """Write loss.png (train and eval loss per optimizer step) and throughput.png (tokens/s per logging
    window) into `out_dir`; return the paths written. A figure without any data is not written.

    history: [{step, loss, ...}] with `tokens_per_s` on the entries that close a logging window;
    eval_history: [{step, eval_loss}] (or `loss`); checkpoint_steps: drawn as dotted lines on the
    throughput figure (a window that contains a checkpoint save is slower)."""

    os.makedirs(out_dir, exist_ok=True)
    prefix = f"{title}: " if title else ""
    paths: list[str] = []

    train = _finite((h["step"], h.get("loss")) for h in history if "step" in h)
    evals = _finite((e["step"], e.get("eval_loss", e.get("loss"))) for e in eval_history if "step" in e)
    if train or evals:
        fig = _figure()
        ax = fig.add_subplot()
        if train:
            xs, ys = zip(*train)
            ax.plot(xs, ys, color="tab:blue", alpha=0.35 if len(train) > 20 else 0.9, lw=1,
                    marker="o" if len(train) <= 50 else None, ms=3, label="train loss (per step)")
            if len(train) > 20:
                window = max(5, len(train) // 20)
                ax.plot(xs, _moving_average(list(ys), window), color="tab:blue", lw=2,
                        label=f"train loss ({window}-step moving average)")
        if evals:
            xs, ys = zip(*evals)
            ax.plot(xs, ys, color="tab:orange", lw=2, marker="s", ms=5, label="eval loss")
        paths.append(_finish(fig, ax, "cross-entropy per supervised token", f"{prefix}loss",
                             os.path.join(out_dir, LOSS_PNG)))

    tput = _finite((h["step"], h.get("tokens_per_s")) for h in history if "step" in h and "tokens_per_s" in h)
    if tput:
        fig = _figure()
        ax = fig.add_subplot()
        xs, ys = zip(*tput)
        # a figure is the mean over its window of steps (previous logged step, this step]: draw it as a stair
        first = min((h["step"] for h in history if "step" in h), default=1) - 1
        edges = [min(first, xs[0] - 1), *xs]
        ax.stairs(ys, edges, color="tab:green", lw=2, baseline=None, label="tokens/s, mean over each logging window")
        ax.plot(xs, ys, ls="none", marker="o", ms=4, color="tab:green")
        ckpts = sorted(c for c in set(checkpoint_steps) if edges[0] < c < xs[-1])
        for i, c in enumerate(ckpts):
            ax.axvline(c, color="tab:red", ls=":", lw=1, label="checkpoint saved"
                       if i == 0 else None)
        if len(ys) > 1:
            # the first window carries start-up (first batches, allocator warm-up): leave it out of the mean
            steady = sum(ys[1:]) / (len(ys) - 1)
            ax.axhline(steady, color="gray", ls="--", lw=1, label=f"mean after the first window: {steady:,.0f}")
        ax.set_ylim(bottom=0)
        paths.append(_finish(fig, ax, "tokens/s, all workers (padding excluded)", f"{prefix}throughput",
                             os.path.join(out_dir, THROUGHPUT_PNG)))
    return paths


def _read_json(path: str) -> dict | None:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def run_history(checkpoint_dir: str | None, tracking_uri: str | None = None,
                run_id: str | None = None) -> tuple[list[dict], list[dict]]:
    """(history, eval_history) of a finished run from its final checkpoint, completed from MLflow."""
    history: list[dict] = []
    evals: list[dict] = []
    if checkpoint_dir:
        state = _read_json(os.path.join(checkpoint_dir, "train_state", "rank0.json")) or {}
        history = [dict(h) for h in state.get("history") or []]
        evals = [dict(e) for e in state.get("eval_history") or []]
        if not history:  # the TRL loop: Hugging Face's trainer state
            for name in ("trainer/trainer_state.json", "trainer_state.json"):
                ts = _read_json(os.path.join(checkpoint_dir, name))
                if ts:
                    for e in ts.get("log_history", []):
                        if "loss" in e and "step" in e:
                            history.append({"step": e["step"], "loss": e["loss"],
                                            **({"lr": e["learning_rate"]} if "learning_rate" in e else {})})
                        if "eval_loss" in e and "step" in e and not state.get("eval_history"):
                            evals.append({"step": e["step"], "eval_loss": e["eval_loss"]})
                    break
    if tracking_uri and run_id:
        try:
            import mlflow

            from raytune_ft.tracking.mlflow_run import mlflow_metric_name

            client = mlflow.MlflowClient(tracking_uri)
            if not any("tokens_per_s" in h for h in history):
                tps = {m.step: m.value for m in client.get_metric_history(run_id, "tokens_per_s")}
                by_step = {h["step"]: h for h in history}
                for step, value in sorted(tps.items()):
                    if step in by_step:
                        by_step[step]["tokens_per_s"] = value
                    else:
                        history.append({"step": step, "tokens_per_s": value})
            if not any("loss" in h for h in history):
                by_step = {h["step"]: h for h in history}
                for m in client.get_metric_history(run_id, mlflow_metric_name("loss")):
                    by_step.setdefault(m.step, {"step": m.step})["loss"] = m.value
                history = list(by_step.values())
            if not evals:
                evals = [{"step": m.step, "eval_loss": m.value}
                         for m in client.get_metric_history(run_id, "eval_loss")]
        except Exception:  # plots are a convenience: a tracking hiccup must not fail the run
            pass
    history.sort(key=lambda h: h["step"])
    evals.sort(key=lambda e: e["step"])
    return history, evals


def log_plots(paths: list[str], tracking_uri: str, run_id: str, artifact_path: str = "plots") -> None:
    """Attach the PNGs to the MLflow run as artifacts under `artifact_path`."""
    import mlflow

    client = mlflow.MlflowClient(tracking_uri)
    for p in paths:
        client.log_artifact(run_id, p, artifact_path=artifact_path)


def plot_finished_run(checkpoint_dir: str | None, out_dir: str, *, tracking_uri: str | None = None,
                      run_id: str | None = None, title: str | None = None,
                      checkpoint_steps: Iterable[int] = ()) -> list[str]:
    """Read a finished run's history, write its plots into `out_dir` and log them to MLflow."""
    history, evals = run_history(checkpoint_dir, tracking_uri, run_id)
    paths = write_run_plots(history, evals, out_dir, title=title, checkpoint_steps=checkpoint_steps)
    if paths and tracking_uri and run_id:
        log_plots(paths, tracking_uri, run_id)
    return paths
