"""The one error type for mistakes a user can fix (bad config, missing file, bad data).

The CLI prints a `UserError` as one line and exits with status 2; any other exception is a bug in
tiller and keeps its traceback.
"""


class UserError(Exception):
    """A problem in what the user gave us: say what and where (file, field, key) in the message."""


class ConfigError(UserError):
    """A configuration key, value or combination that cannot be used."""


class DataError(UserError):
    """A data file that is missing, empty, or lacks a column or field we need."""
