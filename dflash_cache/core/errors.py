"""The base of every error that is the user's to fix (bad input, a misfit cache, a missing GPU).

The CLI prints these as one `error:` line; anything else is a bug and keeps its traceback. This
module imports nothing heavy, so the CLI can catch errors without loading torch's model code.
"""


class UserError(Exception):
    """An error whose message tells the user what to change."""


class ExtractError(UserError, RuntimeError):
    """An extraction that cannot start or go on; the message says why."""
