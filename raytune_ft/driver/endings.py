"""How a run that does not finish ends, in words: its MLflow run's status and tags (FAILED for an error,
KILLED with raytune.ended_by=interrupt for Ctrl-C and SIGTERM from `ray job stop` or a scheduler), and one
line saying where it stopped and how to resume. lifecycle.RunLifecycle ends the run with them.
"""
from __future__ import annotations

import contextlib
import signal
import threading

from raytune_ft.env import redact_exception

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


def raise_stopped(signum, frame):
    """A SIGTERM handler: Stopped, raised in the main thread."""
    raise Stopped(signum)


@contextlib.contextmanager
def sigterm_raises():
    """SIGTERM raises Stopped in the main thread while the block runs, so the run ends in its own words."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    before = signal.signal(signal.SIGTERM, raise_stopped)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, before)


def one_line(exc: BaseException, limit: int = 1000) -> str:
    """An exception's type and words on one line, redacted, for a tag and the console."""
    return " ".join(redact_exception(exc).split())[:limit]


def input_error(exc: BaseException) -> bool:
    """Whether `exc` is an error in what the user gave (a recipe, storage or lease error): said in its own words,
    without a traceback. Found before training began, nothing started (exit 2); found by a worker, the run
    stopped (exit 1, with the line that says which checkpoint is kept)."""
    from raytune_ft.recipe.recipe import RecipeError

    return isinstance(exc, RecipeError) or type(exc).__name__ in ("StorageAccessError", "RunFolderInUse")


def exit_lines(exc: BaseException) -> tuple[int, list[str]] | None:
    """How a job that raised `exc` ends: (its exit code, the lines for stderr); None for an error outside the
    run that is no input error (raised as it is). Exit 2 only when nothing started: an input error on which the
    lifecycle left no ending line (`ending_line`), since it was found before training began."""
    from raytune_ft.env import redact

    line = ending_line(exc)
    if line is None:
        return (2, [f"error: {redact(str(exc))}"]) if input_error(exc) else None
    if input_error(exc):
        said = [f"error: {redact(str(exc))}"]
    elif interrupted(exc):
        said = []
    else:                               # an error's trace, above what to do about it
        said = [redact_exception(exc, with_traceback=True)]
    return exit_code(exc), said + [f"[raytune_ft] {line}"]


def interrupted(exc: BaseException) -> bool:
    """Ctrl-C (SIGINT) or a stop (SIGTERM: `ray job stop`, a scheduler): the user's choice, not a failure."""
    return isinstance(exc, (KeyboardInterrupt, Stopped))


def mlflow_ending(exc: BaseException) -> tuple[str, dict[str, str]]:
    """The MLflow run's status and tags for a job that ended with `exc`: KILLED with raytune.ended_by=interrupt
    for SIGINT and SIGTERM, FAILED with the error's type for anything else; raytune.error says which."""
    if interrupted(exc):
        signame = "SIGINT" if isinstance(exc, KeyboardInterrupt) else signal.Signals(exc.signum).name
        return "KILLED", {"raytune.status": "killed", "raytune.error": f"interrupted ({signame})",
                          "raytune.ended_by": "interrupt"}
    return "FAILED", {"raytune.status": "failed", "raytune.error": one_line(exc),
                      "raytune.ended_by": type(exc).__name__}


def ending_text(exc: BaseException, step: int | None, checkpoint: int | None) -> str:
    """The one line that says where the run stopped (`step`: the last one logged, or the checkpoint's where the
    tracking store received fewer) and how to resume
    (`checkpoint`: the latest checkpoint's step)."""
    what = "interrupted" if interrupted(exc) else "failed"
    if checkpoint is not None and (step is None or step < checkpoint):
        step = checkpoint           # the workers reached at least their checkpoint, whatever the store received
    where = f" at step {step}" if step is not None else " before the first step" if checkpoint is None else ""
    cause = "" if interrupted(exc) else f" ({one_line(exc, 300)})"
    if checkpoint is not None:
        kept = f"the checkpoint at step {checkpoint} is kept; run the same command to resume"
    else:
        kept = "no checkpoint was written; run the same command to start again"
    if not interrupted(exc):
        kept = kept.replace("run the same command", "fix the cause and run the same command")
    return f"{what}{where}{cause}; {kept}"


def checkpoint_step(st, run_path: str) -> int | None:
    """The step of the run folder's latest reported checkpoint (None: none, or unreadable)."""
    try:
        from raytune_ft.storage import fs as storage
        from raytune_ft.train.checkpoint_meta import read_meta_at

        fs, base = st.fs, run_path.rstrip("/")
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
    """The line lifecycle.RunLifecycle left on the exception a run ended with (None: it ended before the run
    began)."""
    return getattr(exc, "raytune_ending", None)
