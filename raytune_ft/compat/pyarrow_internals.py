"""pyarrow's private form of an S3 filesystem's options."""
from __future__ import annotations

from raytune_ft.compat.core import PYARROW, CompatError, installed

# the options an S3FileSystem was built with: pyarrow keeps them in its pickled form only (`__reduce__`:
# a private constructor and a dict of the options), and has no getter for them
S3_OPTIONS_READ = ("endpoint_override", "scheme", "connect_timeout", "request_timeout")


def s3_options(fs) -> dict:
    """The options pyarrow's S3FileSystem `fs` was built with; CompatError where its pickled form changed."""
    try:
        rebuild, (options,) = fs.__reduce__()
    except (TypeError, ValueError) as e:
        raise CompatError(f"{installed('pyarrow')}: {type(fs).__name__}'s pickled form is not a constructor and its "
                          f"options ({e}); checked on {PYARROW}. Update raytune_ft/compat/.") from e
    missing = [k for k in S3_OPTIONS_READ if not isinstance(options, dict) or k not in options]
    if not callable(rebuild) or missing:
        raise CompatError(f"{installed('pyarrow')}: {type(fs).__name__}'s pickled options lack {missing}; "
                          f"checked on {PYARROW}. Update raytune_ft/compat/.")
    return options


def s3_rebuilt(fs, **changes):
    """pyarrow's S3FileSystem `fs` built again with its options and `changes` (S3FileSystem's own arguments)."""
    rebuild, _ = fs.__reduce__()
    return rebuild({**s3_options(fs), **changes})
