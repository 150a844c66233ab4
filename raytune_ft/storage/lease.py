"""Who owns a run folder: a lease file the driver writes when a run starts and refreshes while it runs.

Two jobs on one run folder (a double submit, a retry of a job that only looked stuck) would train into the
same checkpoints, and the orphan cleanup of one would delete the checkpoint the other uploaded but has not
reported yet. So `run()` takes the run folder's lease before it writes anything (no MLflow run, no Ray Train
run), a thread of the driver refreshes its heartbeat while the run goes on, and the lease is given back at
the end, failed or not. A second job that finds a live lease stops at once, naming the owner. A lease is
taken over when its owner is gone: its heartbeat older than `stale_s` (a lost node, a killed driver), or its
process dead on this same host. Workers check that the lease is still their job's before they clear the
orphans of dead attempts (`check_owner`): whatever they clear was left by an attempt of a job that is gone.

The lease goes through the run storage's filesystem (local or s3://). Object stores have no compare-and-swap:
a job writes its lease, waits `settle_s`, and reads it back; the job whose token it finds owns the folder
(two jobs starting in the same instant: the later writer wins, the other stops).
"""
from __future__ import annotations

import json
import os
import socket
import threading
import time
import uuid
from dataclasses import asdict, dataclass
from typing import Callable

import pyarrow.fs as pafs

from raytune_ft.storage import fs as storage
LEASE_FILE = "raytune_lease.json"
# how often the driver refreshes the heartbeat, and how old a heartbeat makes a lease free to take over
HEARTBEAT_ENV, STALE_ENV = "RAYTUNE_LEASE_HEARTBEAT_S", "RAYTUNE_LEASE_STALE_S"
DEFAULT_HEARTBEAT_S, DEFAULT_STALE_S = 30.0, 300.0
# the most giving the lease back takes (a part of the run's ending, lifecycle.END_BOUND_S)
RELEASE_S = 3.0


class RunFolderInUse(RuntimeError):
    """Another job holds the run folder's lease (or took it over from this one)."""


@dataclass
class LeaseRecord:
    token: str
    job_id: str
    host: str
    pid: int
    started: float
    heartbeat: float

    def owner(self) -> str:
        return (f"job {self.job_id} on host {self.host} (pid {self.pid})" if self.job_id
                else f"process {self.pid} on host {self.host}")

    def how_to_stop(self) -> str:
        return f"ray job stop {self.job_id}" if self.job_id else f"kill {self.pid} on {self.host}"


def _seconds(env: str, default: float) -> float:
    try:
        return float(os.environ.get(env) or default)
    except ValueError:
        return default


def job_id() -> str:
    """The Ray job submission id of a driver started by `ray job submit` (Ray hands the driver its job
    config in this variable before it connects), else "" (a process started by hand)."""
    try:
        config = json.loads(os.environ.get("RAY_JOB_CONFIG_JSON_ENV_VAR") or "{}")
        return str((config.get("metadata") or {}).get("job_submission_id") or "")
    except (ValueError, AttributeError):  # a label here: never a reason to fail a run
        return ""


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:      # someone else's process: alive
        return True
    return True


def read(fs: pafs.FileSystem, run_path: str) -> LeaseRecord | None:
    """The run folder's lease, None when there is none (or it is unreadable: a torn write is no owner)."""
    try:
        raw = storage.read_json(fs, f"{run_path.rstrip('/')}/{LEASE_FILE}")
        return LeaseRecord(**raw) if raw else None
    except (ValueError, TypeError):
        return None


def _why_free(rec: LeaseRecord, now: float, stale_s: float) -> str | None:
    """Why the lease `rec` may be taken over (None: its owner is alive)."""
    age = now - rec.heartbeat
    if age > stale_s:
        return f"its heartbeat is {age:.0f} s old (more than {stale_s:g} s)"
    if rec.host == socket.gethostname() and not _pid_alive(rec.pid):
        return "its process is gone"
    return None


def in_use_message(uri: str, rec: LeaseRecord, now: float, stale_s: float) -> str:
    return (f"run folder {uri} is in use by {rec.owner()}, started {time.ctime(rec.started)}, last heartbeat "
            f"{max(0.0, now - rec.heartbeat):.0f} s ago. Two jobs on one run folder would overwrite each "
            f"other's checkpoints, so this one stops. Wait for that job to end (or stop it: {rec.how_to_stop()}), "
            "or give this run another tracking.run_name. If that job is dead, its lease is "
            f"taken over once its heartbeat is older than {stale_s:g} s ({STALE_ENV}), or at once when its "
            "process is gone from this host.")


class Lease:
    """This job's hold on a run folder: `acquire` it, `start` its heartbeat, `release` it at the end."""

    def __init__(self, fs: pafs.FileSystem, run_path: str, uri: str, record: LeaseRecord,
                 log: Callable[[str], None] = storage._print):
        self.fs, self.run_path, self.uri, self.record, self.log = fs, run_path.rstrip("/"), uri, record, log
        self.lost_to: LeaseRecord | None = None
        self.made_folder = False          # the run folder did not exist before this lease: released, it goes if empty
        self._stop = threading.Event()
        self._released = False       # the lease file is gone (or was not this job's)
        self._attempted = False      # a release was tried (the ending's, with its deadline)
        self._thread: threading.Thread | None = None

    @property
    def token(self) -> str:
        return self.record.token

    @property
    def path(self) -> str:
        return f"{self.run_path}/{LEASE_FILE}"

    @classmethod
    def acquire(cls, st: storage.Storage, run_path: str, *, stale_s: float | None = None, settle_s: float = 0.5,
                log: Callable[[str], None] = storage._print) -> "Lease":
        """Take the run folder's lease; RunFolderInUse when another live job holds it."""
        stale_s = _seconds(STALE_ENV, DEFAULT_STALE_S) if stale_s is None else stale_s
        uri = st.uri(run_path)
        now = time.time()
        held = read(st.fs, run_path)
        if held is not None:
            why = _why_free(held, now, stale_s)
            if why is None:
                raise RunFolderInUse(in_use_message(uri, held, now, stale_s))
            log(f"taking over the lease of {uri} from {held.owner()}: {why}")
        rec = LeaseRecord(token=uuid.uuid4().hex, job_id=job_id(), host=socket.gethostname(), pid=os.getpid(),
                          started=now, heartbeat=now)
        lease = cls(st.fs, run_path, uri, rec, log)
        lease.made_folder = not storage.exists(st.fs, run_path)
        lease._write()
        time.sleep(settle_s)         # a job that wrote at the same moment: the last writer's token stays
        found = read(st.fs, run_path)
        if found is None or found.token != rec.token:
            if found is None:
                raise RunFolderInUse(f"run folder {uri}: this job's lease vanished right after it was written "
                                     "(another job is starting on this folder); submit again in a minute")
            raise RunFolderInUse(in_use_message(uri, found, time.time(), stale_s))
        return lease

    def _write(self) -> None:
        storage.write_json(self.fs, self.path, asdict(self.record))    # whole: never read half-written

    def beat(self) -> bool:
        """Refresh the heartbeat; False (and nothing written) when another job has taken the lease over."""
        found = read(self.fs, self.run_path)
        if found is not None and found.token != self.token:
            if self.lost_to is None:
                self.log(f"the lease of {self.uri} was taken over by {found.owner()}: this job's heartbeat had "
                         "gone stale; its workers stop at their next start")
            self.lost_to = found
            return False
        self.record.heartbeat = time.time()
        self._write()
        return True

    def start(self, every_s: float | None = None) -> "Lease":
        """Refresh the heartbeat from a daemon thread every `every_s` seconds until `release`."""
        every_s = _seconds(HEARTBEAT_ENV, DEFAULT_HEARTBEAT_S) if every_s is None else every_s

        def loop():
            while not self._stop.wait(every_s):
                try:
                    if not self.beat():
                        return
                except OSError as e:   # a storage hiccup: the next beat tries again, well before stale_s
                    self.log(f"could not refresh the lease of {self.uri}: {type(e).__name__}")

        self._thread = threading.Thread(target=loop, name="raytune-lease", daemon=True)
        self._thread.start()
        return self

    def release(self, timeout_s: float = RELEASE_S) -> None:
        """Stop the heartbeat and delete the lease file if it is still this job's, within `timeout_s`: on a
        storage that does not answer the file is left behind (said), goes stale and is taken over."""
        from raytune_ft.channel import call_within

        if self._released:           # given back already: a second release neither waits nor touches storage
            return
        self._attempted = True
        deadline = time.monotonic() + timeout_s
        self._stop.set()
        if self._thread is not None:   # a beat under way on a storage that hangs is left to its thread
            self._thread.join(timeout=timeout_s / 2)

        def delete() -> None:
            found = read(self.fs, self.run_path)
            if found is not None and found.token == self.token:
                self.fs.delete_file(self.path)
                # a run refused before it wrote anything leaves no folder behind
                if self.made_folder and storage.is_dir(self.fs, self.run_path) and not self.fs.get_file_info(
                        pafs.FileSelector(self.run_path, allow_not_found=True)):
                    self.fs.delete_dir(self.run_path)

        try:
            call_within(max(deadline - time.monotonic(), 0.1), "lease release", delete)
            self._released = True
        except OSError as e:  # NoAnswer too: left behind, it goes stale and is taken over (a later release retries)
            self.log(f"could not release the lease of {self.uri}: {type(e).__name__}")

    def __enter__(self) -> "Lease":
        return self

    def __exit__(self, *exc) -> None:
        if not self._attempted:      # the ending released it already, within its deadline: not a second wait
            self.release()


def hold(st: storage.Storage, run_path: str, **kwargs) -> Lease:
    """The run folder's lease, taken and its heartbeat started; use as a context manager to give it back."""
    return Lease.acquire(st, run_path, **kwargs).start()


def check_owner(fs: pafs.FileSystem, run_path: str, token: str | None, uri: str | None = None) -> None:
    """Raise RunFolderInUse unless the run folder's lease is `token`'s (None: no lease to check)."""
    if not token:
        return
    found = read(fs, run_path)
    if found is None or found.token != token:
        owner = found.owner() if found else "no job (the lease is gone)"
        raise RunFolderInUse(f"run folder {uri or run_path} is now held by {owner}, not by this job, whose "
                             "heartbeat had gone stale: this job stops so that two jobs do not write into one "
                             "run folder")

