"""The order of a run: validate -> open run -> fit -> register, read top-down through its lifecycle
(lifecycle.RunLifecycle). The only module that knows training and registry."""
from __future__ import annotations

import os
import time
from dataclasses import asdict, dataclass, field
from typing import NamedTuple

from raytune_ft.env import process_start, public_uri, redact_exception
from raytune_ft.recipe.recipe import Recipe
from raytune_ft.driver.lifecycle import RunLifecycle


# `mlflow ui`'s page of an experiment's training runs (its routes are behind a # in MLflow 3's UI)
RUNS_VIEW = "http://127.0.0.1:5000/#/experiments/{}/runs"
# the most a trained run's end waits on reads of the tracking store and on its plots (made from the
# checkpoint's histories, logged to MLflow): a store that does not answer costs the summary these, said
READ_BACK_S, PLOTS_S = 30.0, 60.0


@dataclass
class RunSummary:
    job: str
    run_name: str
    status: str                                # registered | trained_not_registered | trained
    steps: int = 0
    passes: int = 0                            # over the data: train.max_steps past one pass repeats it
    tokens: int = 0                            # the run's, over every attempt
    tokens_per_s: float = 0.0                  # this attempt's: attempt_tokens / attempt_seconds
    attempt_tokens: int = 0                    # trained by this attempt (a resumed run's later part)
    attempt_seconds: float = 0.0               # this attempt's training seconds
    run_seconds: float = 0.0                   # training seconds of every attempt
    run_tokens_per_s: float = 0.0              # tokens / run_seconds
    steps_tokens_per_s: float = 0.0            # the training steps' own rate: the last logging window's
    final_loss: float | None = None
    best_loss: float | None = None
    checkpoint: str | None = None
    registered_name: str | None = None
    registered_version: str | None = None
    registration_error: str | None = None
    retry_command: str | None = None
    mlflow_run_id: str | None = None
    mlflow_experiment_id: str | None = None
    tracking_uri: str | None = None
    data: dict = field(default_factory=dict)
    seconds: float = 0.0
    plots: list = field(default_factory=list)
    # the time to the first optimizer step by phase (ray_workers_s ... first_step_s) and its total_s
    startup: dict = field(default_factory=dict)

    def lines(self) -> list[str]:
        loop_rate = f"{self.tokens_per_s:,.0f} tokens/s over the training loop, saves and evals included"
        out = [f"job {self.job} (run {self.run_name}): {self.status}",
               f"  steps            {self.steps}"
               + (f" ({self.passes} passes over the data)" if self.passes > 1 else ""),
               f"  tokens           {self.tokens:,} ({loop_rate})" if self.attempt_tokens == self.tokens else
               f"  tokens           {self.tokens:,} ({self.run_tokens_per_s:,.0f} tokens/s over the run); "
               f"this attempt {self.attempt_tokens:,} ({loop_rate})",
               f"  final loss       {self.final_loss:.4f}" if self.final_loss is not None else "  final loss       n/a"]
        if self.steps_tokens_per_s:
            out.insert(3, f"  training steps   {self.steps_tokens_per_s:,.0f} tokens/s (the last logged steps)")
        if self.best_loss is not None:
            out.append(f"  best eval loss   {self.best_loss:.4f}")
        out.append(f"  checkpoint       {self.checkpoint}")
        if self.registered_version is not None:
            out.append(f"  registered       {self.registered_name} version {self.registered_version}")
        elif self.registration_error:
            out.append(f"  NOT registered   {self.registration_error}")
            out.append(f"  retry with       {self.retry_command}")
        if self.data:
            from raytune_ft.data.report import rows_line, source_lines

            out.append(f"  data             {rows_line(self.data)}, "
                       f"{self.data.get('blocks', 0)} blocks{_padding_share(self.data)}")
            out.extend(source_lines(self.data))
        out.append(f"  mlflow           {self.tracking_uri} run {self.mlflow_run_id}")
        if self.tracking_uri and self.tracking_uri.startswith(("sqlite:", "file:", "/")):
            import shlex

            # a store on this machine has no server to open: this serves it on http://127.0.0.1:5000
            out.append(f"  browse with      mlflow ui --backend-store-uri {shlex.quote(self.tracking_uri)}")
            if self.mlflow_experiment_id:   # MLflow 3's UI opens on GenAI traces: the training runs' tab
                out.append(f"  then open        {RUNS_VIEW.format(self.mlflow_experiment_id)}")
        if self.plots:
            out.append(f"  plots            {', '.join(self.plots)} (also MLflow artifacts under plots/)")
        out.append(f"  wall time        {self.seconds:.0f} s")
        return out


def merged_data_counters(checkpoint_dir: str, fs=None) -> dict:
    """Every rank's data counters of a checkpoint, read where it lies (`fs`: its filesystem, default local)."""
    import pyarrow.fs as pafs

    from raytune_ft.storage import fs as storage
    from raytune_ft.data.packing import DataCounters

    fs = fs or pafs.LocalFileSystem()
    total = DataCounters()
    for info in sorted(storage.list_files(fs, f"{checkpoint_dir.rstrip('/')}/train_state", recursive=False),
                       key=lambda i: i.path):
        if not (info.base_name.startswith("rank") and info.base_name.endswith(".json")):
            continue
        st = storage.read_json(fs, info.path) or {}
        if st.get("counters"):
            total.merge(DataCounters.from_dict(st["counters"]))
    return total.to_dict()


def _write_plots(recipe: Recipe, st, run_path: str, ckpt, run_id: str, last_step: int) -> list[str]:
    """Loss and throughput PNGs in <run folder>/plots, logged to the MLflow run; never fails the run, and
    never holds its end past PLOTS_S (a tracking store or object storage that does not answer: said).

    Only the two small history files are read from the checkpoint (rank 0's train state, the trainer
    state); on object storage the PNGs are made in a temporary folder and uploaded to the run folder."""
    from raytune_ft.channel import call_within

    try:
        return call_within(PLOTS_S, "plots", _make_plots, recipe, st, run_path, ckpt, run_id, last_step)
    except Exception as e:
        print(f"[raytune_ft] plots skipped: {redact_exception(e)}")
        return []


def _make_plots(recipe: Recipe, st, run_path: str, ckpt, run_id: str, last_step: int) -> list[str]:
    import tempfile

    from raytune_ft.storage import fs as storage
    from raytune_ft.tracking.plots import plot_finished_run

    with tempfile.TemporaryDirectory(prefix="raytune_plots_") as tmp:
        src = os.path.join(tmp, "checkpoint")
        # the FSDP2 loop writes the first, the TRL loop both; download copies nothing of a missing one
        for rel in ("train_state/rank0.json", "trainer/trainer_state.json"):
            storage.download(ckpt.filesystem, f"{ckpt.path.rstrip('/')}/{rel}",
                             os.path.dirname(os.path.join(src, rel)))
        out = os.path.join(tmp, "plots") if st.remote else os.path.join(run_path, "plots")
        every = recipe.train.checkpoint_every
        paths = plot_finished_run(src, out, tracking_uri=recipe.tracking_uri, run_id=run_id,
                                  title=recipe.tracking.run_name,
                                  checkpoint_steps=range(every, last_step, every)
                                  if recipe.train.loop == "fsdp2" else ())
        if st.remote:
            storage.upload(out, st.fs, f"{run_path}/plots")
            paths = [st.uri(f"{run_path}/plots/{os.path.basename(p)}") for p in paths]
        return paths


def _padding_share(data: dict) -> str:
    """", padding P% of the trained tokens (N all-padding blocks evened the ranks out)" for the data row."""
    total = data.get("real_tokens", 0) + data.get("padding_tokens", 0)
    if not total:
        return ""
    even = data.get("equalisation_padding_blocks", 0)
    return (f", padding {data.get('padding_tokens', 0) / total:.1%} of the trained tokens"
            + (f" ({even} all-padding blocks evened the ranks out)" if even else ""))


def _data_record(data: dict) -> dict:
    """The merged data counters with their totals and fractions, for the run's data.json: single values,
    so not MLflow metrics (each would be a one-point chart ahead of the loss curves)."""
    from raytune_ft.data.packing import DataCounters

    if not data:
        return {}
    c = DataCounters.from_dict(data)
    total = c.real_tokens + c.padding_tokens
    counts = {k: v for k, v in c.to_dict().items() if k != "skipped_rows"}     # those go to skipped_rows.jsonl
    return {**counts, "rows_skipped": c.rows_skipped,
            "padding_fraction": c.padding_tokens / total if total else 0.0,
            "packing_efficiency": c.real_tokens / total if total else 0.0}


def _data_files(st, run_path: str, record: dict, data: dict) -> dict:
    """data.json and (where rows were skipped) skipped_rows.jsonl written to the run folder; the same two for
    the MLflow run (name -> document)."""
    from raytune_ft.data.report import DATA_FILE, SKIPPED_ROWS_FILE, skipped_rows_text
    from raytune_ft.storage import fs as storage

    out: dict = {}
    if record:
        storage.write_json(st.fs, f"{run_path}/{DATA_FILE}", record)
        out[DATA_FILE] = record
    if text := skipped_rows_text(data):
        storage.write_text(st.fs, f"{run_path}/{SKIPPED_ROWS_FILE}", text)
        out[SKIPPED_ROWS_FILE] = data["skipped_rows"]
    return out


def _last_logged_metrics(recipe: Recipe, run_id: str, timeout_s: float = READ_BACK_S) -> dict:
    """The latest value of each metric of the MLflow run under the loop's names, the start-up params as
    `startup/<phase>_s`, and `step`: the last step logged. {} where the store fails or does not answer
    within `timeout_s` (READ_BACK_S; said)."""
    from raytune_ft.channel import call_within

    def read() -> dict:
        from mlflow import MlflowClient

        from raytune_ft.tracking.mlflow_run import loop_metric_name, mlflow_metric_name, startup_from_params

        client = MlflowClient(tracking_uri=recipe.tracking_uri)
        run = client.get_run(run_id)
        out: dict = {loop_metric_name(k): v for k, v in run.data.metrics.items()}
        out |= {f"startup/{k}": v for k, v in startup_from_params(run.data.params).items()}
        history = client.get_metric_history(run_id, mlflow_metric_name("loss"))
        if history:
            out["step"] = max(m.step for m in history)
        return out

    try:
        return call_within(timeout_s, "metrics read-back", read)
    except Exception as e:  # tracking down: the summary goes without the end-of-run figures
        print(f"[raytune_ft] could not read the run's metrics back from MLflow: {type(e).__name__}")
        return {}


def _set_throughput(summary: RunSummary, metrics: dict) -> None:
    """tokens/s of this attempt (its tokens over its seconds) and of the run (every attempt's)."""
    summary.attempt_tokens = int(metrics.get("attempt_tokens", summary.tokens))
    summary.attempt_seconds = float(metrics.get("train_seconds") or 0.0)
    summary.run_seconds = float(metrics.get("run_train_seconds") or summary.attempt_seconds)
    if summary.attempt_seconds:
        summary.tokens_per_s = summary.attempt_tokens / summary.attempt_seconds
    if summary.run_seconds:
        summary.run_tokens_per_s = summary.tokens / summary.run_seconds
    summary.steps_tokens_per_s = float(metrics.get("tokens_per_s") or 0.0)


def run(recipe: Recipe, *, local: bool = False, register: bool | None = None) -> RunSummary:
    """Validate, train on Ray Train, then register the final checkpoint from a separate Ray task. However it
    ends, its lifecycle gives back what it took: the MLflow run ended with the reason, the lease."""
    with RunLifecycle(recipe, local=local) as life:
        return _run(recipe, life, register=register)


def _fit(recipe: Recipe, life: RunLifecycle):
    """Ray Train's result and the MLflow run's id. An error no retry can fix (storage full, ...) is said in
    plain words, not as Ray's wrapping of it; the lifecycle ends the MLflow run with it."""
    from raytune_ft.driver.launch import build_datasets, build_trainer, start_tokenizing, unfixable_error
    from raytune_ft.train.startup_clock import JobStart

    # the launch's own: the tokenizing processes (beside Ray Train's start, the tokenizer loaded by the first
    # read) and the datasets, built while the MLflow run opens in its own process
    start_tokenizing(recipe)
    datasets = build_datasets(recipe)
    life.marks["datasets"] = time.time()
    trainer = build_trainer(recipe, mlflow_run_key=life.run_key(), lease_token=life.lease.token,
                            job=JobStart(life.job_start, life.marks), prebuilt=datasets)
    try:
        result = life.fit(trainer)
    except Exception as e:
        life.run_id()   # a run that did not open stops here, in its own words (FinishedRunError, the store's)
        unfixable = unfixable_error(e)
        if unfixable is not None:
            raise unfixable from e
        raise
    return result, life.run_id()


class _Ending(NamedTuple):
    """What a fit ends with: the run's summary, its final checkpoint's meta and URI (None without one)."""
    summary: RunSummary
    meta: dict
    ckpt_uri: str | None


def _summarize(recipe: Recipe, result, run_id: str, st, run_path: str) -> _Ending:
    """The run's summary from Ray Train's result and its final checkpoint's small files (plots made); the
    checkpoint's meta and URI."""
    from raytune_ft.storage import fs as storage
    ckpt = result.checkpoint
    metrics = result.metrics or {}
    if not recipe.train.save_final:
        # Ray Train keeps the metrics of checkpointed reports only: the end of a run without a final
        # checkpoint is read back from the MLflow run the loop logged it to
        metrics = _last_logged_metrics(recipe, run_id) or metrics
    if ckpt is None and recipe.train.save_final:
        raise RuntimeError("training finished without a checkpoint")
    from raytune_ft.train.checkpoint_meta import read_meta_at

    meta, data, plots, ckpt_uri = {}, {}, [], None
    if ckpt is not None:   # the small files are read where the checkpoint lies: nothing else is fetched
        ckpt_uri = storage.open_checkpoint(ckpt.path, ckpt.filesystem)[2]
        meta = read_meta_at(ckpt.filesystem, ckpt.path)
        data = merged_data_counters(ckpt.path, ckpt.filesystem)
        plots = _write_plots(recipe, st, run_path, ckpt, run_id, int(meta.get("step") or 0))
    summary = RunSummary(
        job=recipe.job, run_name=recipe.tracking.run_name, status="trained", steps=int(metrics.get("step", 0)),
        passes=int(metrics.get("passes", 0)),
        tokens=int(metrics.get("tokens", 0)), final_loss=meta.get("final_loss", metrics.get("loss")),
        best_loss=meta.get("best_eval_loss"), checkpoint=public_uri(ckpt_uri),
        mlflow_run_id=run_id,
        tracking_uri=public_uri(recipe.tracking_uri), data=data, plots=plots)
    _set_throughput(summary, metrics)
    summary.startup = {k[len("startup/"):]: float(v) for k, v in metrics.items() if k.startswith("startup/")}
    return _Ending(summary, meta, ckpt_uri)


def _run(recipe: Recipe, life: RunLifecycle, *, register: bool | None) -> RunSummary:
    """One pass, in the order a run happens; each step once. Everything that can refuse the run is checked
    before anything is held: a refused run holds no lease, opens no MLflow run and starts no Ray."""
    from raytune_ft.driver import preflight

    t0 = time.time()
    do_register = recipe.registry.enabled if register is None else register
    # validate, and check everything before Ray: storage, tracking store, a finished run, data, resources
    checked = preflight.check_before_ray(recipe, local=life.local, joins=life.joins, register=do_register)
    if checked.finished is not None:   # nothing to train or register: nothing is held, Ray is not started
        known = {k: v for k, v in checked.finished.items() if k in RunSummary.__dataclass_fields__}
        return RunSummary(**{**known, "seconds": time.time() - min(process_start() or t0, t0)})
    # hold the run folder, open the MLflow run, start Ray beside it
    life.hold_folder(checked.storage, checked.run_path)
    life.start(t0)
    life.start_ray()
    # fit
    result, run_id = _fit(recipe, life)
    # end: the summary from the final checkpoint
    ending = _summarize(recipe, result, run_id, checked.storage, checked.run_path)
    # register, close the MLflow run, write summary.json
    return _register_and_close(recipe, ending, life, checked.data_notes, register=do_register)


def _register_and_close(recipe: Recipe, ending: _Ending, life: RunLifecycle, data_notes: list[str], *,
                        register: bool) -> RunSummary:
    """Register the final checkpoint (once: a re-submit finds the version it has), close the MLflow run with
    the outcome and the data's params (data/report.data_params), write summary.json to the run folder `life`
    holds."""
    from raytune_ft.data.report import data_params

    from raytune_ft.storage import fs as storage

    from raytune_ft.tracking import mlflow_run as tracking
    summary, meta, ckpt_uri = ending
    st, run_path = life.storage, life.run_path
    run_id, data = summary.mlflow_run_id, summary.data
    # a run that ended without its final checkpoint (train.save_final=false) is resumed by a re-submit
    status_tags = {"raytune.status": "trained", "raytune.checkpoint": ckpt_uri or "",
                   tracking.FINAL_CHECKPOINT_TAG: "true" if meta.get("final") else "false"}
    if register:
        from raytune_ft.registry import find_registered_version, run_registration
        from raytune_ft.registry.base import RegistrationOutcome

        # a checkpoint is registered once: a re-submitted finished run returns the version it already has
        found = find_registered_version(ckpt_uri, recipe.registry.name, tracking_uri=recipe.tracking_uri,
                                        registry_uri=recipe.registry.registry_uri,
                                        timeout_s=recipe.registry.timeout_s)
        if found is not None:
            print(f"[raytune_ft] {public_uri(ckpt_uri)} is already registered as {found.name} version {found.version}")
            outcome = RegistrationOutcome(ok=True, result=found)
        else:
            outcome = run_registration(ckpt_uri, recipe.registry, recipe.tracking_uri,
                                       metadata={**meta, "job": recipe.job}, run_id=run_id)
        if outcome.ok:
            summary.status = "registered"
            if outcome.result is not None:  # None when registry.enabled is false (skipped)
                summary.registered_name, summary.registered_version = outcome.result.name, str(outcome.result.version)
            # the version itself is the registry's tag, raytune.registered_model_version
            status_tags.update({"raytune.status": "registered"})
        else:
            summary.status = "trained_not_registered"
            summary.registration_error = outcome.error
            summary.retry_command = outcome.retry_command
            status_tags.update({"raytune.status": "trained_not_registered"})
    summary.seconds = time.time() - life.job_start
    record = _data_record(data)
    # the padding share also as a run metric, beside the final loss: a column to compare runs by
    ends = {"final_loss": summary.final_loss or float("nan"), "total_tokens": summary.tokens,
            **({"padding_fraction": record["padding_fraction"]} if record else {})}
    # the run is trained and (maybe) registered: a store that does not answer loses none of it (said)
    artifacts = _data_files(st, run_path, record, data)
    summary.mlflow_experiment_id = life.finish(status_tags, ends, artifacts or None, data_params(data_notes, data))
    storage.write_json(st.fs, f"{run_path}/{storage.SUMMARY_FILE}", asdict(summary))
    tracking.keep_tracking_db(recipe, st, run_path)
    return summary

