"""The one error type for mistakes a user can fix (bad config, missing file, bad data).

The CLI prints a `UserError` as one line and exits with status 2, and an environment fault (an `OSError`
such as a full disk, a read-only or missing directory, a permission) as one line naming the path with status 1;
any other exception is a bug in tiller and keeps its traceback.
"""


class UserError(Exception):
    """A problem in what the user gave us: say what and where (file, field, key) in the message."""


class ConfigError(UserError):
    """A configuration key, value or combination that cannot be used."""


class DataError(UserError):
    """A data file that is missing, empty, or lacks a column or field we need."""


def describe_os_error(err: OSError) -> str:
    """One line for an environment fault: what failed and on which path (`[Errno 28] No space left on device:
    'runs/x/checkpoints'` -> `No space left on device: runs/x/checkpoints`)."""
    what = err.strerror or type(err).__name__
    paths = [p for p in (err.filename, err.filename2) if p]
    return f"{what}: {' -> '.join(str(p) for p in paths)}" if paths else f"{what} ({err})"
