"""Recovery after a lost worker: a recipe run whose training worker is SIGKILLed once its first checkpoint is
registered, timed from the kill to the next attempt's first step.

    python bench/recovery.py -- python jobs/qwen27b_b300.py --local --set ...    (python -m bench gpu recovery)

The job runs as a child in a process group of its own, its output passed through, each line stamped as it
arrives. Once Ray Train's checkpoint snapshot is in the run's folder (`--run-dir`), one of the job's
`RayTrainWorker` processes is killed; the clock stops at the next `start-up ... to the end of the first step`
line (rank 0 of the new attempt). The lines in between that say where the time went (Ray Train's
warnings, the new attempt's start-up breakdown) are kept in the figures. Prints `RESULT {json}`.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time

SNAPSHOT = "checkpoint_manager_snapshot.json"
FIRST_STEP = re.compile(r"start-up ([\d.]+) s to the end of the first step")
# the parts of the start-up line after the new workers' processes started
RAY_WORKERS = re.compile(r"Ray and workers ([\d.]+) s")
WORKER_SETUP = re.compile(r"worker imports and process group ([\d.]+)")


def job_workers(root_pid: int) -> list:
    """The `RayTrainWorker` processes under `root_pid` (the job's local Ray) or, on a Ray started apart
    (`ray job submit`), anywhere on this node."""
    import psutil

    try:
        mine = psutil.Process(root_pid).children(recursive=True)
    except psutil.NoSuchProcess:
        mine = []
    found = [p for p in mine if _is_train_worker(p)]
    return found or [p for p in psutil.process_iter() if _is_train_worker(p)]


def _is_train_worker(p) -> bool:
    import psutil

    try:
        return "RayTrainWorker" in " ".join(p.cmdline())
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return False


class Killer(threading.Thread):
    """Kills the last-started training worker once `run_dir` holds Ray Train's checkpoint snapshot."""

    def __init__(self, root_pid: int, run_dir: str, timeout_s: float):
        super().__init__(daemon=True)
        self.root_pid, self.run_dir, self.timeout_s = root_pid, run_dir, timeout_s
        self.killed_at: float | None = None
        self.killed: str = ""
        self.error: str | None = None
        self.stop = threading.Event()

    def run(self) -> None:
        deadline = time.time() + self.timeout_s
        while not os.path.exists(os.path.join(self.run_dir, SNAPSHOT)):
            if self.stop.is_set() or time.time() > deadline:
                self.error = "no checkpoint registered in time"
                return
            time.sleep(0.05)
        workers = job_workers(self.root_pid)
        if not workers:
            self.error = "no RayTrainWorker process found"
            return
        victim = max(workers, key=lambda p: p.create_time())
        self.killed = f"pid {victim.pid}"
        victim.send_signal(signal.SIGKILL)
        self.killed_at = time.time()
        print(f"=== recovery: SIGKILL sent to the training worker {self.killed}", flush=True)


def run(argv: list[str], run_dir: str, timeout_s: float) -> dict:
    t0 = time.time()
    # unbuffered: each line is stamped when it is written, not when a buffer fills
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors="replace",
                            process_group=0, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    killer = Killer(proc.pid, run_dir, timeout_s)
    killer.start()
    firsts: list[tuple[float, float, str]] = []     # (arrival, the line's start-up total, the line)
    after_kill: list[str] = []
    for line in proc.stdout:
        now = time.time()
        sys.stdout.write(line)
        m = FIRST_STEP.search(line)
        if m:
            firsts.append((now, float(m.group(1)), line))
        if killer.killed_at is not None and not (len(firsts) > 1 and firsts[-1][0] > killer.killed_at):
            after_kill.append(f"{now - killer.killed_at:7.1f} s  {line.rstrip()[:300]}")
    code = proc.wait()
    killer.stop.set()
    killer.join(timeout=5)
    fig: dict = {"exit": code, "job_s": round(time.time() - t0, 1), "killed": killer.killed}
    if killer.error:
        fig["error"] = killer.error
    later = [f for f in firsts if killer.killed_at is not None and f[0] > killer.killed_at]
    if later:
        arrival, total, line = later[0]
        fig["kill_to_first_step_s"] = round(arrival - killer.killed_at, 1)
        fig["next_attempt_startup_s"] = total
        ray_workers, setup = RAY_WORKERS.search(line), WORKER_SETUP.search(line)
        if ray_workers and setup:
            # the new attempt's line counts from the job's start: what follows its workers' process start is
            # its own; the rest of the time since the kill went to noticing the death, stopping the old workers
            # and scheduling new ones
            own = total - float(ray_workers.group(1)) + float(setup.group(1))
            fig["new_workers_own_start_s"] = round(own, 1)
            fig["kill_to_new_workers_s"] = round(arrival - killer.killed_at - own, 1)
    fig["lines_after_kill"] = after_kill[-60:]
    return fig


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--run-dir", required=True, help="the run's folder (tracking.storage_path/run_name)")
    p.add_argument("--timeout", type=float, default=900, help="seconds to wait for the first checkpoint")
    p.add_argument("job", nargs=argparse.REMAINDER, help="-- then the job's command")
    opts = p.parse_args(argv)
    job = opts.job[1:] if opts.job[:1] == ["--"] else opts.job
    fig = run(job, opts.run_dir, opts.timeout)
    print("RESULT " + json.dumps(fig), flush=True)
    return 0 if fig["exit"] == 0 and "kill_to_first_step_s" in fig else 1


if __name__ == "__main__":
    sys.exit(main())
