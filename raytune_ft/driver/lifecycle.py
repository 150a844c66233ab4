"""The one life of a run in the driver (`RunLifecycle`): what it holds, in the order it takes it, and how it
gives it back however the job ends."""
from __future__ import annotations

import concurrent.futures
import contextlib
import os
import signal
import sys
import time

from raytune_ft.env import process_start
from raytune_ft.recipe.recipe import Recipe, check_tracking_store

# the most the ending takes, all parts together (one channel.Deadline): the MLflow run ended by the opener's
# process (at most tracking.opening.END_WAIT_S of it), the checkpoint's step read, the opener's process
# closed, the lease given back, the handed-over key deleted; each part's own cap below
END_BOUND_S = 15.0
# of it, kept for the process's own exit after the ending (its exit handlers, a loaded host's teardown)
EXIT_RESERVE_S = 2.5
CKPT_READ_S = 2.0
CLOSE_WAIT_S = 2.0
RELEASE_WAIT_S = 3.0
KEY_WAIT_S = 2.0
# a run whose opening is still under way when the driver needs its id (after fit): the most it waits
RUN_ID_WAIT_S = 120.0


class RunLifecycle:
    """A run's life in the driver, a context manager that `run()` reads top-down through. It holds what a run
    holds (the lease, the MLflow run, Ray) and nothing else (the datasets and the tokenizing processes are the
    launch's: driver/launch.py). It takes, in order:

    1. the run folder: `hold_folder` takes its lease (storage/lease.py), once every check has passed;
    2. the MLflow run: `start` opens it ahead, in a process of its own (tracking/opening.RunOpening), beside the
       driver's imports and tokenizer (a thread); on a cluster joined it opens once the cluster is checked;
    3. Ray: `start_ray` starts or joins it, then starts what Ray Train waits for (Ray Data's coordinator);
       `run_key` hands the run id to rank 0 (tracking/opening.RunIdHandoff), the one way it reaches the
       workers, so the trainer never waits for the run to open;
    4. `finish` ends the MLflow run of a job that returned, with its outcome.

    `fit` runs the trainer. However the block ends (a return, an exception, Ctrl-C, SIGTERM from `ray job
    stop`: the lifecycle holds both signals while the block runs, SIGTERM raising endings.Stopped),
    `__exit__` gives everything back within END_BOUND_S, SIGINT and SIGTERM ignored meanwhile: the MLflow run
    ended KILLED or FAILED with its reason (endings.mlflow_ending) by the opener's process, which waits for
    a run still opening and is killed where the store does not answer in time; the line saying where the
    run stopped left on the exception (endings.ending_line); the opener's process ended and the lease given
    back; then the handed-over key deleted (bounded: a Ray that a Ctrl-C ended with the driver's process group
    does not answer) and the threads left. Ray is left up: a local one ends with this process, a later run of
    the same process reuses it.
    `marks` are the driver's side of the start-up breakdown (train/startup_clock.DRIVER_MARKS)."""

    def __init__(self, recipe: Recipe, *, local: bool):
        self.recipe, self.local = recipe, local
        self.joins = bool(os.environ.get("RAY_ADDRESS")) or (
            "ray" in sys.modules and sys.modules["ray"].is_initialized())
        self.storage = self.run_path = self.lease = None
        self.opened = None                # run_opening.RunOpening
        self.training = False             # Ray Train's fit begun (`fit`)
        self.marks: dict = {}
        self.job_start = process_start() or time.time()
        self._held = contextlib.ExitStack()
        self._handoff = None              # tracking.opening.RunIdHandoff
        self._prepared = None
        self._signals: dict = {}

    def __enter__(self) -> "RunLifecycle":
        if _main_thread():           # restored at the end
            self._signals = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
        self._hold_signals()
        return self

    def _hold_signals(self) -> None:
        """SIGTERM raises endings.Stopped in the main thread (ray.init puts in a handler that exits the process
        instead); SIGINT raises KeyboardInterrupt, as Python's own handler does."""
        from raytune_ft.driver.endings import raise_stopped

        if self._signals:
            signal.signal(signal.SIGTERM, raise_stopped)
            signal.signal(signal.SIGINT, signal.default_int_handler)

    # 1. the run folder
    def hold_folder(self, st, run_path: str):
        """Take the run folder's lease (one job per run folder: a second one stops here, before Ray starts, an
        MLflow run opens or a checkpoint is touched); given back at the end."""
        from raytune_ft.storage import lease
        self.storage, self.run_path = st, run_path
        self.lease = self._held.enter_context(lease.hold(st, run_path))
        return self.lease

    # 2. the MLflow run, and the driver's imports beside it
    def start(self, t0: float) -> None:
        """The driver's imports and tokenizer in a thread (start_ahead.prepare_driver) and, on a Ray this job
        starts (one node: the node check cannot fail), the MLflow run's opening."""
        from raytune_ft.driver.start_ahead import prepare_driver

        self.marks["driver"], self.job_start = t0, min(self.job_start, t0)
        pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="raytune-start")
        self._held.callback(pool.shutdown, wait=False)   # a stopped run ends without waiting for imports
        self._prepared = pool.submit(prepare_driver, self.recipe)
        if not self.joins:
            self.open_run()

    def open_run(self) -> None:
        """Open the MLflow run ahead, in a process of its own (run_opening.RunOpening)."""
        from raytune_ft.tracking.opening import RunOpening

        # entered last, so given back first: the ending (__exit__) ends its run before it is closed
        self.opened = self._held.enter_context(RunOpening(self.recipe))

    # 3. Ray
    def start_ray(self) -> None:
        """Ray up (started or joined) and checked; the MLflow run opening; the driver's imports done."""
        from raytune_ft.driver import preflight
        from raytune_ft.driver.start_ahead import ensure_ray, start_train_helpers, submitted_at

        ensure_ray(self.local)
        self._hold_signals()
        self.marks["ray_start"] = time.time()
        submitted = submitted_at() if self.joins else None
        if submitted is not None:   # `ray job submit`: the wait starts at the submission (the process's start
            # time has a resolution of 10 ms: a driver Ray started at once may seem to start before it)
            self.marks["process"], self.job_start = self.job_start, min(submitted, self.job_start)
        check_tracking_store(self.recipe, preflight.cluster_nodes(), "nodes of the Ray cluster it joined")
        if self.joins:
            import ray

            preflight.check_resources(self.recipe, ray.cluster_resources(), "the Ray cluster it joined")
            self.open_run()
        start_train_helpers()
        self._prepared.result()

    def run_key(self) -> str:
        """Where rank 0 finds the run id: handed over once the run is open (at once if it is; a run that
        failed to open and is done raises here, in the driver)."""
        from raytune_ft.tracking.opening import RunIdHandoff

        if self.opened.done():
            self.opened.result()
        self._handoff = self._held.enter_context(RunIdHandoff(self.opened, self.lease.token))
        self.marks["tracking"] = time.time()
        return self._handoff.key

    def fit(self, trainer):
        """`trainer.fit()`, run in a thread of its own while the main thread waits: Ray Train takes SIGINT in
        the main thread (to abort its run, then exit the process), so from here the lifecycle keeps hearing
        Ctrl-C and ends the run in its own words. The trainer's error is raised here."""
        import threading

        outcome: dict = {}
        self.training = True       # from here an input error is a worker's, found mid-run (endings.exit_lines)

        def fit() -> None:
            try:
                outcome["result"] = trainer.fit()
            except BaseException as e:  # noqa: BLE001 - raised in the main thread
                outcome["error"] = e

        thread = threading.Thread(target=fit, name="raytune-fit", daemon=True)
        thread.start()
        while thread.is_alive():
            thread.join(timeout=0.5)
        if "error" in outcome:
            raise outcome["error"]
        return outcome["result"]

    def run_id(self) -> str:
        """The MLflow run's id, waiting at most RUN_ID_WAIT_S for it to open; its error (FinishedRunError, the
        store's, or a TimeoutError) raised."""
        return self.opened.result(RUN_ID_WAIT_S)

    # 4. the end of a job that returned
    def finish(self, tags: dict, metrics: dict, json_artifacts: dict | None, params: dict | None = None) -> str | None:
        """End the MLflow run FINISHED with the job's outcome: tags, metrics, JSON files and params (the data's,
        data/report.data_params), all through the opener's process, within its bound; the run's experiment
        id, None where the store did not answer (said)."""
        from raytune_ft.tracking.opening import END_WAIT_S

        answer = self.opened.end("FINISHED", tags, timeout=END_WAIT_S, metrics=metrics,
                                 json_artifacts=json_artifacts, params=params)
        if not answer.get("ended"):
            print(f"[raytune_ft] could not close the MLflow run within {END_WAIT_S:.0f} s (the tracking store did "
                  "not answer); it stays RUNNING until a re-submit")
        return answer.get("experiment_id")

    def __exit__(self, kind, exc, tb) -> None:
        from raytune_ft.channel import Deadline

        for s in self._signals:      # the ending is not cut short; the handlers before the run come back last
            signal.signal(s, signal.SIG_IGN)
        deadline = Deadline(END_BOUND_S - EXIT_RESERVE_S)   # every part below waits for what is left, no more
        try:
            if exc is not None:
                self._end(exc, deadline)
            if self.opened is not None:   # first: a handoff still waiting for the run id stops waiting
                self.opened.close(deadline.left(CLOSE_WAIT_S))
            if self.lease is not None:    # before anything that may wait on a Ray gone with the driver's group
                self.lease.release(deadline.left(RELEASE_WAIT_S))
            if self._handoff is not None:
                self._handoff.close(deadline.left(KEY_WAIT_S))
        finally:
            try:
                self._held.close()     # what is left: each part above is closed already (a second close is free)
            finally:
                for s, handler in self._signals.items():
                    signal.signal(s, handler)

    def _end(self, exc: BaseException, deadline) -> None:
        """The MLflow run ended with `exc`'s reason, and the line said on `exc` (not for an error found before
        the run was anyone's: the CLI prints it alone)."""
        from raytune_ft.channel import NoAnswer, call_within
        from raytune_ft.driver import endings
        from raytune_ft.tracking.opening import END_WAIT_S

        answer = {}
        if self.opened is not None:
            status, tags = endings.mlflow_ending(exc)
            answer = self.opened.end(status, tags, timeout=deadline.left(END_WAIT_S))
            if not answer:
                print(f"[raytune_ft] the MLflow run did not end within {END_WAIT_S:.0f} s (its opener or the tracking "
                      "store did not answer): its opener is stopped; a re-submit reopens a run it left RUNNING")
        if endings.input_error(exc) and not self.training:     # refused before training: nothing started
            return
        ckpt = None
        if self.storage is not None:
            try:
                ckpt = call_within(deadline.left(CKPT_READ_S), "checkpoint read", endings.checkpoint_step,
                                   self.storage, self.run_path)
            except NoAnswer:         # a storage that does not answer: the line goes without the step
                pass
        with contextlib.suppress(AttributeError):   # the CLI prints it (`ending_line`)
            exc.raytune_ending = endings.ending_text(exc, answer.get("step"), ckpt)


def _main_thread() -> bool:
    import threading

    return threading.current_thread() is threading.main_thread()
