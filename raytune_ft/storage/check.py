"""Object storage checked before anything starts: a run whose bucket it cannot use fails in seconds, in words.

Without this, wrong or missing S3 credentials, or an endpoint nobody answers at, surface only once Ray
Train first writes to storage: a long pyarrow traceback that names no credential, after Ray has started
and the MLflow run was opened (and stays RUNNING). `check_storage` runs first instead: one small probe
object is written, read back and deleted, each request with short timeouts and no retries (the probe as
a whole is tried again after a server error that says to try again), all bounded by a deadline. A
failure says which endpoint was tried, which environment variables were read (their names, never their
values), and which step failed. Local and shared folders are not probed.
"""
from __future__ import annotations

import os
import threading
import time
import uuid
from typing import TYPE_CHECKING

import pyarrow.fs as pafs

from raytune_ft import compat
from raytune_ft.env import public_uri, redact
from raytune_ft.storage import fs as storage

if TYPE_CHECKING:
    from raytune_ft.recipe.recipe import Recipe

# what the AWS SDK (and so pyarrow) reads from the environment to reach and sign in to S3
AWS_ENV = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE",
           "AWS_SHARED_CREDENTIALS_FILE", "AWS_CONFIG_FILE", *storage.ENDPOINT_ENV, *storage.REGION_ENV)
CONNECT_TIMEOUT_S = 5.0
REQUEST_TIMEOUT_S = 10.0
DEADLINE_S = 30.0           # the whole probe; a stuck request is abandoned to its daemon thread

_REFUSED = ("access_denied", "accessdenied", "invalidaccesskeyid", "signaturedoesnotmatch", "forbidden",
            "invalid_access_key", "signature_does_not_match", "http status 403", "expiredtoken")
_UNREACHABLE = ("network_connection", "curlcode", "could not connect", "timed out", "timeout",
                "couldn't resolve", "could not resolve", "connection refused")
_NO_BUCKET = ("nosuchbucket", "no_such_bucket", "bucket does not exist")
# a server's passing trouble (S3's 500 InternalError, 503 SlowDown): the probe is tried again, not failed
_TRANSIENT = ("internal_failure", "internalerror", "please try again", "slow_down", "slowdown",
              "service_unavailable", "serviceunavailable", "http status 500", "http status 503")
PROBE_ATTEMPTS = 3


class StorageAccessError(RuntimeError):
    """tracking.storage_path cannot be written, read or cleaned up with this environment's credentials."""


def _quick(fs: pafs.FileSystem) -> pafs.FileSystem:
    """The same S3 filesystem with short timeouts and a single attempt per request (the SDK's default
    retries a refused connection for seconds; a probe should say so at once)."""
    return compat.s3_rebuilt(fs, connect_timeout=CONNECT_TIMEOUT_S, request_timeout=REQUEST_TIMEOUT_S,
                             retry_strategy=pafs.AwsStandardS3RetryStrategy(max_attempts=1))


def _endpoint(fs: pafs.FileSystem) -> str:
    """The endpoint `fs` talks to, and what named it."""
    options = compat.s3_options(fs)
    where, scheme = options["endpoint_override"], options["scheme"] or "https"
    if not where:
        return "AWS S3's own endpoint (no AWS_ENDPOINT_URL_S3 / AWS_ENDPOINT_URL set)"
    named_by = next((k for k in storage.ENDPOINT_ENV if os.environ.get(k)), None)
    return f"{scheme}://{where}" + (f" (from {named_by})" if named_by else " (from tracking.storage_path)")


def _variables() -> str:
    env = os.environ
    found = [k for k in AWS_ENV if env.get(k)]
    missing = [k for k in AWS_ENV if not env.get(k)]
    return (f"read from the environment: {', '.join(found) or 'none of them'}; "
            f"not set: {', '.join(missing) or 'none'} (names only)")


def _what_failed(step: str, exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}"
    low = text.lower()
    first = redact(text.splitlines()[0] if text.strip() else type(exc).__name__)[:400]
    if any(t in low for t in _REFUSED):
        why = "the endpoint refused the credentials (a wrong or expired key, or no right to this bucket)"
        if not os.environ.get("AWS_ACCESS_KEY_ID") and not os.environ.get("AWS_PROFILE"):
            why = "no credentials were found (AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY, or AWS_PROFILE)"
    elif any(t in low for t in _NO_BUCKET):
        why = "the bucket does not exist"
    elif any(t in low for t in _UNREACHABLE):
        why = "the endpoint cannot be reached"
    else:
        why = "the storage answered with an error"
    return f"{why}; {step} failed: {first}"


def _transient(exc: BaseException) -> bool:
    low = f"{type(exc).__name__}: {exc}".lower()
    return any(t in low for t in _TRANSIENT) and not any(t in low for t in _REFUSED + _NO_BUCKET)


def probe(st: storage.Storage, folder: str) -> None:
    """Write, read back and delete one small object under `folder` (a path on `st.fs`); raise
    StorageAccessError naming what failed. Leaves nothing behind when the write went through. A server
    error that says to try again is tried again (`PROBE_ATTEMPTS` in all, within the deadline)."""
    fs = _quick(st.fs)
    path = f"{folder.rstrip('/')}/.raytune_probe_{uuid.uuid4().hex}"
    payload = b"raytune_ft storage probe\n"
    outcome: dict = {}

    def attempts():
        for n in range(PROBE_ATTEMPTS):
            outcome.pop("error", None)
            attempt()
            error = outcome.get("error")
            if error is None or n == PROBE_ATTEMPTS - 1 or not _transient(error[1]):
                return
            time.sleep(1.0 + n)

    def attempt():
        step, written = f"writing {st.uri(path)}", False
        try:
            storage.write_bytes(fs, path, payload)
            written = True
            step = f"reading back {st.uri(path)}"
            if storage.read_bytes(fs, path) != payload:
                raise OSError("the object read back differs from the one written")
            step = f"deleting {st.uri(path)}"
            fs.delete_file(path)
            written = False
        except BaseException as e:  # noqa: BLE001 - reported by the caller's thread
            outcome["error"] = (step, e)
        finally:
            if written:             # a read that failed: the probe object still goes
                try:
                    fs.delete_file(path)
                except OSError:
                    pass

    worker = threading.Thread(target=attempts, name="raytune-storage-probe", daemon=True)
    worker.start()
    worker.join(DEADLINE_S)
    if worker.is_alive():
        outcome["error"] = (f"writing {st.uri(path)}",
                            TimeoutError(f"no answer within {DEADLINE_S:g} s (timed out)"))
    if "error" in outcome:
        step, exc = outcome["error"]
        raise StorageAccessError(unusable(f"tracking.storage_path: {public_uri(st.uri())} cannot be used", step, exc,
                                          st.fs))


def unusable(head: str, step: str, exc: BaseException, fs) -> str:
    """The message of object storage that failed its probe (this one, or a data source's: preflight): `head`,
    which `step` failed and why, the endpoint and the credential variables seen, and what to do."""
    return (f"{head}: {_what_failed(step, exc)}.\n  endpoint: {_endpoint(fs)}\n  {_variables()}\n"
            "Nothing was started. Set the credentials (or the endpoint) in the environment of the machine that "
            "submits the run and of every node, then submit again.")


def check_storage(recipe: "Recipe") -> None:
    """Probe the run's object storage (see the module docstring); local and shared folders pass as they are."""
    st, run_path = storage.run_storage(recipe)
    if st.remote:
        probe(st, run_path)
