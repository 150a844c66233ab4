"""The order of a run: validate -> fit -> register. The only module that knows training and registry."""
from __future__ import annotations

import glob
import json
import os
import time
from dataclasses import asdict, dataclass, field

from raytune_ft.recipe import Recipe, validate


@dataclass
class RunSummary:
    job: str
    run_name: str
    status: str                                # registered | trained_not_registered | trained
    steps: int = 0
    tokens: int = 0
    tokens_per_s: float = 0.0
    final_loss: float | None = None
    best_loss: float | None = None
    checkpoint: str | None = None
    registered_name: str | None = None
    registered_version: str | None = None
    registration_error: str | None = None
    retry_command: str | None = None
    mlflow_run_id: str | None = None
    tracking_uri: str | None = None
    data: dict = field(default_factory=dict)
    seconds: float = 0.0
    plots: list = field(default_factory=list)

    def lines(self) -> list[str]:
        out = [f"job {self.job} (run {self.run_name}): {self.status}",
               f"  steps            {self.steps}",
               f"  tokens           {self.tokens:,} ({self.tokens_per_s:,.0f} tokens/s)",
               f"  final loss       {self.final_loss:.4f}" if self.final_loss is not None else "  final loss       n/a"]
        if self.best_loss is not None:
            out.append(f"  best eval loss   {self.best_loss:.4f}")
        out.append(f"  checkpoint       {self.checkpoint}")
        if self.registered_version is not None:
            out.append(f"  registered       {self.registered_name} version {self.registered_version}")
        elif self.registration_error:
            out.append(f"  NOT registered   {self.registration_error}")
            out.append(f"  retry with       {self.retry_command}")
        if self.data:
            skipped = self.data.get("rows_skipped_by_reason") or {}
            out.append(f"  data             {self.data.get('rows_read', 0)} rows read, "
                       f"{sum(skipped.values())} skipped {dict(skipped) if skipped else ''}, "
                       f"{self.data.get('blocks', 0)} blocks")
        out.append(f"  mlflow           {self.tracking_uri} run {self.mlflow_run_id}")
        if self.plots:
            out.append(f"  plots            {', '.join(self.plots)} (also MLflow artifacts under plots/)")
        out.append(f"  wall time        {self.seconds:.0f} s")
        return out


def ensure_ray(local: bool) -> None:
    """Join the cluster when RAY_ADDRESS is set (as under `ray job submit`), else start a local Ray.

    A bare `ray.init()` would join whatever /tmp/ray/ray_current_cluster names, even a dead cluster.
    """
    import ray

    if ray.is_initialized():
        return
    if os.environ.get("RAY_ADDRESS"):
        ray.init()
        return
    # more logical CPUs than cores: Ray Data operators inside the trainer must not starve
    ncpu = max(8, 2 * (os.cpu_count() or 2)) if local else None
    ray.init(address="local", num_cpus=ncpu, include_dashboard=False)


def merged_data_counters(checkpoint_dir: str) -> dict:
    from raytune_ft.data.packing import DataCounters

    total = DataCounters()
    for path in sorted(glob.glob(os.path.join(checkpoint_dir, "train_state", "rank*.json"))):
        with open(path) as f:
            st = json.load(f)
        if st.get("counters"):
            total.merge(DataCounters.from_dict(st["counters"]))
    return total.to_dict()


def _write_plots(recipe: Recipe, ckpt_dir: str, run_id: str, last_step: int) -> list[str]:
    """Loss and throughput PNGs in <run folder>/plots, logged to the MLflow run; never fails the run."""
    import tempfile

    from raytune_ft.plots import plot_finished_run

    out = os.path.join(recipe.run_dir, "plots") if "://" not in recipe.run_dir else tempfile.mkdtemp()
    try:
        every = recipe.train.checkpoint_every
        return plot_finished_run(ckpt_dir, out, tracking_uri=recipe.tracking_uri, run_id=run_id,
                                 title=recipe.tracking.run_name, checkpoint_steps=range(every, last_step, every)
                                 if recipe.train.loop == "fsdp2" else ())
    except Exception as e:
        print(f"[raytune_ft] plots skipped: {type(e).__name__}: {e}")
        return []


def _data_metrics(data: dict) -> dict:
    """The merged data counters as MLflow metrics: data/rows_read, data/rows_skipped/<reason>, ..."""
    from raytune_ft.data.packing import DataCounters

    if not data:
        return {}
    c = DataCounters.from_dict(data)
    m = c.as_metrics()
    total = c.real_tokens + c.padding_tokens
    m["data/padding_fraction"] = c.padding_tokens / total if total else 0.0
    return m


def _last_logged_metrics(recipe: Recipe, run_id: str) -> dict:
    """The latest value of each metric of the MLflow run, and `step`: the last step logged."""
    try:
        from mlflow import MlflowClient

        client = MlflowClient(tracking_uri=recipe.tracking_uri)
        out: dict = dict(client.get_run(run_id).data.metrics)
        history = client.get_metric_history(run_id, "loss")
        if history:
            out["step"] = max(m.step for m in history)
        return out
    except Exception as e:  # tracking down: the summary goes without the end-of-run figures
        print(f"[raytune_ft] could not read the run's metrics back from MLflow: {type(e).__name__}")
        return {}


def run(recipe: Recipe, *, local: bool = False, register: bool | None = None) -> RunSummary:
    """Validate, train on Ray Train, then register the final checkpoint from a separate Ray task."""
    from raytune_ft import tracking
    from raytune_ft.train.checkpoint import read_meta
    from raytune_ft.train.launch import build_trainer

    validate(recipe)
    t0 = time.time()
    ensure_ray(local)
    run_id = tracking.start_run(recipe)
    trainer = build_trainer(recipe, mlflow_run_id=run_id, total_steps=recipe.train.max_steps)
    try:
        result = trainer.fit()
    except BaseException as e:
        tracking.end_run(recipe, run_id, status="FAILED", tags={"raytune.status": "failed",
                                                                "raytune.error": f"{type(e).__name__}: {e}"[:4000]})
        raise
    ckpt = result.checkpoint
    metrics = result.metrics or {}
    if not recipe.train.save_final:
        # Ray Train keeps the metrics of checkpointed reports only: the end of a run without a final
        # checkpoint is read back from the MLflow run the loop logged it to
        metrics = _last_logged_metrics(recipe, run_id) or metrics
    if ckpt is None and recipe.train.save_final:
        raise RuntimeError("training finished without a checkpoint")
    meta, data, plots = {}, {}, []
    if ckpt is not None:
        with ckpt.as_directory() as ckpt_dir:
            meta = read_meta(ckpt_dir)
            data = merged_data_counters(ckpt_dir)
            plots = _write_plots(recipe, ckpt_dir, run_id, int(meta.get("step") or 0))
    summary = RunSummary(
        job=recipe.job, run_name=recipe.tracking.run_name, status="trained", steps=int(metrics.get("step", 0)),
        tokens=int(metrics.get("tokens", 0)), final_loss=meta.get("final_loss", metrics.get("loss")),
        best_loss=meta.get("best_eval_loss"), checkpoint=ckpt.path if ckpt is not None else None,
        mlflow_run_id=run_id,
        tracking_uri=recipe.tracking_uri, data=data, plots=plots)
    secs = metrics.get("train_seconds") or 0
    summary.tokens_per_s = summary.tokens / secs if secs else 0.0

    do_register = recipe.registry.enabled if register is None else register
    status_tags = {"raytune.status": "trained", "raytune.checkpoint": ckpt.path if ckpt is not None else ""}
    if do_register:
        from raytune_ft.registry import run_registration

        outcome = run_registration(ckpt.path, recipe.registry, recipe.tracking_uri,
                                   metadata={**meta, "job": recipe.job}, run_id=run_id)
        if outcome.ok:
            summary.status = "registered"
            if outcome.result is not None:  # None when registry.enabled is false (skipped)
                summary.registered_name, summary.registered_version = outcome.result.name, str(outcome.result.version)
            status_tags.update({"raytune.status": "registered",
                                "raytune.registered_version": str(summary.registered_version)})
        else:
            summary.status = "trained_not_registered"
            summary.registration_error = outcome.error
            summary.retry_command = outcome.retry_command
            status_tags.update({"raytune.status": "trained_not_registered"})
    summary.seconds = time.time() - t0
    try:
        tracking.end_run(recipe, run_id, tags=status_tags,
                         metrics={"final_loss": summary.final_loss or float("nan"), "total_tokens": summary.tokens,
                                  **_data_metrics(data)})
    except Exception as e:  # the run is trained and (maybe) registered: tracking must not lose it
        print(f"[raytune_ft] could not close the MLflow run: {type(e).__name__}")
    summary_path = os.path.join(recipe.run_dir, "summary.json") if "://" not in recipe.run_dir else None
    if summary_path:
        os.makedirs(os.path.dirname(summary_path), exist_ok=True)
        with open(summary_path, "w") as f:
            json.dump(asdict(summary), f, indent=2, default=str)
    return summary
