"""The failures of a full or size-limited storage turned into errors that name the storage and say what
to do (`StorageFullError` via `disk_full_error`, `FileTooLargeError` via `too_large_error`).
`raytune_ft.storage.fs` re-exports every name here."""
from __future__ import annotations

import errno


class StorageFullError(RuntimeError):
    """The storage cannot take the next checkpoint (or ran out while writing it)."""

    def __init__(self, storage: str, needed: int | None, free: int | None, what: str = "the next checkpoint",
                 cause: str | None = None):
        self.storage, self.needed, self.free, self.what, self.cause = storage, needed, free, what, cause
        parts = [f"storage {storage} is full: {what} needs"]
        parts.append(f"{fmt_bytes(needed)} ({needed:,} bytes)" if needed is not None else "more space")
        if free is not None:
            parts.append(f"and {fmt_bytes(free)} ({free:,} bytes) are free")
        msg = " ".join(parts) + (". " if not cause else f" ({cause}). ")
        msg += ("The last good checkpoint is kept. Free space there (old runs, unregistered checkpoint_* "
                "folders), lower train.keep_checkpoints, or point tracking.storage_path at larger storage, "
                "then re-submit the run under the same name to resume.")
        super().__init__(msg)

    def __reduce__(self):  # Ray ships worker exceptions to the driver by pickling them
        return (type(self), (self.storage, self.needed, self.free, self.what, self.cause))


def fmt_bytes(n: float | None) -> str:
    if n is None:
        return "unknown"
    for unit, size in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(n) >= size:
            return f"{n / size:.1f} {unit}"
    return f"{int(n)} B"


_FULL_TEXT = ("no space left on device", "disk quota exceeded", "not enough space", "unexpected pos",
              "inline_container", "enospc", "quotaexceeded")


def is_disk_full(exc: BaseException) -> bool:
    """Whether `exc` (or what caused it) is an out-of-space failure, however the writer worded it.

    torch's zip writer reports a short write as `[enforce fail at inline_container.cc] unexpected pos`.
    """
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, StorageFullError):
            return True
        if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        text = str(exc).lower()
        if any(t in text for t in _FULL_TEXT):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def disk_full_error(exc: BaseException, storage_uri: str, needed: int | None, free: int | None,
                    what: str = "the checkpoint") -> StorageFullError | None:
    """The StorageFullError to raise instead of `exc`, or None when `exc` is not about space."""
    if isinstance(exc, StorageFullError):
        return exc
    if not is_disk_full(exc):
        return None
    first = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else type(exc).__name__
    return StorageFullError(storage_uri, needed, free, what, cause=f"the write failed: {first}")


class FileTooLargeError(RuntimeError):
    """One file of a checkpoint is larger than the storage takes as one file or object: not a full disk."""

    def __init__(self, storage: str, what: str, limit: str, cause: str):
        self.storage, self.what, self.limit, self.cause = storage, what, limit, cause
        super().__init__(f"storage {storage}: a file of {what} is too large for it ({cause}). Free space does not "
                         f"help: {limit}. The last good checkpoint is kept.")

    def __reduce__(self):
        return (type(self), (self.storage, self.what, self.limit, self.cause))


# (how the writer words it, what the limit is and what to do about it)
_TOO_LARGE = (
    ("entitytoolarge", "the S3 service refused an object of that size: S3 takes at most 5 GB in one PUT and "
                       "5 TB in a multipart upload, and an S3-compatible server may set its largest object "
                       "lower (raise that setting, or use a filesystem path)"),
    ("file too large", "the filesystem, or the process's `ulimit -f`, has a maximum file size below the "
                       "file's (FAT32/vfat: 4 GB); use a filesystem without that limit or raise the ulimit"),
)


def too_large_error(exc: BaseException, storage_uri: str, what: str = "the checkpoint") -> FileTooLargeError | None:
    """The FileTooLargeError to raise instead of `exc` (EFBIG, S3's EntityTooLarge), or None."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, FileTooLargeError):
            return exc
        text = str(exc).lower()
        efbig = isinstance(exc, OSError) and exc.errno == errno.EFBIG
        for key, limit in _TOO_LARGE:
            if key in text or (efbig and key == "file too large"):
                first = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else type(exc).__name__
                return FileTooLargeError(storage_uri, what, limit, f"the write failed: {first}")
        exc = exc.__cause__ or exc.__context__
    return None
