"""The process environment: credentials it holds are never written anywhere, settings borrowed from it go back.

Credentials (Databricks, Hugging Face, MLflow tokens) are read by MLflow and the hub client from the
environment only. Everything the project writes that could carry one (a log line, an exception's text, a
param, a tag, a failure record, a retry command) goes through `redact`, `redact_exception`, `scrub` or
`public_uri` first: they know the values by the variables' names, so no list of tokens is kept anywhere.

`scoped_env` is the one way to set variables for a block and put the previous values back (a Ray worker
process is reused across tasks, and tests share one process).
"""
from __future__ import annotations

import contextlib
import os
import re
import traceback
import urllib.parse
from typing import Any, Iterable, Iterator

# Names of environment variables whose values are credentials.
SECRET_NAME = re.compile(r"token|secret|password|passwd|credential|api[_-]?key|access[_-]?key", re.IGNORECASE)
_URI_PASSWORD = re.compile(r"(://[^/\s:@]+):[^@\s/]+@")


def secret_values() -> list[str]:
    """Values of credential-looking environment variables in this process (long enough to be meaningful)."""
    return [v for k, v in os.environ.items() if SECRET_NAME.search(k) and v and len(v) >= 8]


def redact(text: str) -> str:
    """`text` with every credential value from the environment and any URI password replaced by ***."""
    for v in sorted(secret_values(), key=len, reverse=True):
        text = text.replace(v, "***")
    # user:password@host inside URIs (tracking URIs of self-hosted servers sometimes carry them)
    return _URI_PASSWORD.sub(r"\1:***@", text)


def redact_exception(exc: BaseException, *, with_traceback: bool = False) -> str:
    """An exception as text fit for a log, a tag or a file: "Type: message", or the whole traceback
    (chained causes included) with `with_traceback`, redacted either way.

    Logging with exc_info=True would write the raw text; log this instead."""
    if with_traceback:
        return redact("".join(traceback.format_exception(exc)).rstrip())
    return redact(f"{type(exc).__name__}: {exc}")


def scrub(obj: Any) -> Any:
    """User metadata fit to log: secret-looking keys dropped, secret values redacted, at any depth."""
    if isinstance(obj, dict):
        return {str(k): scrub(v) for k, v in obj.items() if not SECRET_NAME.search(str(k))}
    if isinstance(obj, (list, tuple)):
        return [scrub(v) for v in obj]
    if isinstance(obj, str):
        return redact(obj)
    if obj is None or isinstance(obj, (bool, int, float)):
        return obj
    return redact(str(obj))


def public_uri(uri: str | None) -> str | None:
    """A URI fit for a log line or a file: no userinfo password, no query string (tokens live there)."""
    if not uri:
        return uri
    parsed = urllib.parse.urlsplit(uri)
    if parsed.password or parsed.query:
        netloc = parsed.hostname or ""
        if parsed.username:
            netloc = f"{parsed.username}@{netloc}"
        if parsed.port:
            netloc += f":{parsed.port}"
        uri = urllib.parse.urlunsplit((parsed.scheme, netloc, parsed.path, "", ""))
    return redact(uri)


@contextlib.contextmanager
def scoped_env(values: dict[str, str] | None = None, *, keep: Iterable[str] = ()) -> Iterator[None]:
    """Set `values` for the block; afterwards those variables and the ones named in `keep` (which code in
    the block may change) are as they were before it."""
    saved = {k: os.environ.get(k) for k in [*(values or {}), *keep]}
    os.environ.update(values or {})
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
