"""How a run that does not finish ends: its MLflow run closed as FAILED (an error) or KILLED (Ctrl-C, SIGTERM
from `ray job stop` or a scheduler) with a one-line reason, and one line saying where it stopped and how to
resume. The run folder's lease is given back by `run()`'s ExitStack, which this sits inside of.

`ray job stop` sends SIGTERM and kills the job 3 s later (Ray's RAY_JOB_STOP_WAIT_TIME_S): the MLflow run is
closed first, the line is read from the run folder and the store after it.
"""
from __future__ import annotations

import contextlib
import signal
import threading

from raytune_ft.env import redact_exception
from raytune_ft.recipe import Recipe

# the exit codes of a shell for a process ended by SIGINT and SIGTERM
EXIT_CODES = {signal.SIGINT: 130, signal.SIGTERM: 143}


class Stopped(BaseException):
    """SIGTERM reached the driver (`ray job stop`, a scheduler's stop). A BaseException, as KeyboardInterrupt
    is: nothing that catches Exception on the way must swallow it."""

    def __init__(self, signum: int = signal.SIGTERM):
        super().__init__(f"stopped by {signal.Signals(signum).name}")
        self.signum = signum


def exit_code(exc: BaseException) -> int:
    """The process's exit code for an ending: 130 for Ctrl-C, 143 for SIGTERM, 1 for an error."""
    if isinstance(exc, KeyboardInterrupt):
        return EXIT_CODES[signal.SIGINT]
    if isinstance(exc, Stopped):
        return EXIT_CODES[exc.signum]
    return 1


@contextlib.contextmanager
def sigterm_raises():
    """SIGTERM raises Stopped in the main thread while the block runs, so the run ends in its own words."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def stop(signum, frame):
        raise Stopped(signum)

    before = signal.signal(signal.SIGTERM, stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, before)


def one_line(exc: BaseException, limit: int = 1000) -> str:
    """An exception's type and words on one line, redacted, for a tag and the console."""
    return " ".join(redact_exception(exc).split())[:limit]


class RunEnding:
    """What `run()` knows of the run so far (its MLflow run once opening, its storage and folder), to end
    it when the block raises. `line` holds what to print once it has."""

    def __init__(self, recipe: Recipe):
        self.recipe = recipe
        self.opened = None            # run_opening.RunOpening
        self.storage = self.run_path = None
        self.line: str | None = None

    def __enter__(self) -> "RunEnding":
        return self

    def __exit__(self, kind, exc, tb) -> None:
        if exc is None:
            return
        from raytune_ft.recipe import RecipeError

        # a recipe, storage or lease error stops the run before it is anyone's: the CLI prints it alone
        if isinstance(exc, RecipeError) or type(exc).__name__ in ("StorageAccessError", "RunFolderInUse"):
            return
        signalled = isinstance(exc, (KeyboardInterrupt, Stopped))
        run_id = self._run_id()
        reason = ("interrupted (SIGINT)" if isinstance(exc, KeyboardInterrupt) else
                  f"stopped ({signal.Signals(exc.signum).name})" if isinstance(exc, Stopped) else one_line(exc))
        if run_id:
            with contextlib.suppress(Exception):   # the store down: the ending line is still printed
                from raytune_ft.tracking import end_run

                end_run(self.recipe, run_id, status="KILLED" if signalled else "FAILED",
                        tags={"raytune.status": "killed" if signalled else "failed", "raytune.error": reason,
                              "raytune.ended_by": type(exc).__name__})
        self.line = self._line(exc, signalled, run_id)
        with contextlib.suppress(AttributeError):   # the CLI prints it (`ending_line`)
            exc.raytune_ending = self.line


    def _run_id(self) -> str | None:
        opened = self.opened
        if opened is None:
            return None
        try:
            if not opened.done():
                # a run still opening is waited for briefly: SIGINT reached its process too
                opened.wait(timeout=2.0)
            return opened.result() if opened.done() else None
        except BaseException:  # noqa: BLE001 - it did not open (or is a finished run): nothing to end
            return None

    def _line(self, exc: BaseException, signalled: bool, run_id: str | None) -> str:
        step = self._last_step(run_id)
        ckpt = self._checkpoint_step()
        what = ("interrupted" if isinstance(exc, KeyboardInterrupt) else
                f"stopped by {signal.Signals(exc.signum).name}" if isinstance(exc, Stopped) else "failed")
        where = f" at step {step}" if step is not None else " before the first step" if not ckpt else ""
        cause = "" if signalled else f" ({one_line(exc, 300)})"
        if ckpt is not None:
            kept = f"the checkpoint at step {ckpt} is kept; run the same command to resume"
        else:
            kept = "no checkpoint was written; run the same command to start again"
        if not signalled:
            kept = kept.replace("run the same command", "fix the cause and run the same command")
        return f"{what}{where}{cause}; {kept}"

    def _last_step(self, run_id: str | None) -> int | None:
        if not run_id:
            return None
        try:
            from mlflow import MlflowClient

            from raytune_ft.tracking import mlflow_metric_name

            history = MlflowClient(self.recipe.tracking_uri).get_metric_history(run_id, mlflow_metric_name("loss"))
            return max(m.step for m in history) if history else None
        except Exception:  # noqa: BLE001 - the line goes without it
            return None

    def _checkpoint_step(self) -> int | None:
        if self.storage is None:
            return None
        try:
            from raytune_ft import storage
            from raytune_ft.train.checkpoint_meta import read_meta_at

            fs, base = self.storage.fs, self.run_path.rstrip("/")
            reported = storage.reported_checkpoints(fs, base)
            latest = reported.latest if reported else None
            if latest is None:
                return None
            step = (reported.metrics.get(latest) or {}).get("step")
            if step is None:
                step = read_meta_at(fs, f"{base}/{latest}").get("step")
            return int(step) if step is not None else None
        except Exception:  # noqa: BLE001 - the line goes without it
            return None


def ending_line(exc: BaseException) -> str | None:
    """The line RunEnding left on the exception a run ended with (None: it ended before the run began)."""
    return getattr(exc, "raytune_ending", None)
