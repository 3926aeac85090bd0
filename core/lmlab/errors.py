"""The one user-facing error type, and the one way to warn the user."""

import sys


class UserError(Exception):
    """Bad input from the user: a manifest key, a file, a command-line value.

    The CLI prints the message on one line and exits with status 2, never a traceback. ``key`` is the
    dotted manifest key (``attention.n_kv_heads``) or file the message is about, when there is one.
    Plugins raise it for option combinations their types cannot express.
    """

    def __init__(self, message: str, key: str | None = None):
        self.key, self.message = key, message
        super().__init__(f"{key}: {message}" if key else message)


def warn(message: str) -> None:
    """One line on stderr that the user should read, whatever else is printed or hidden."""
    print(f"lmlab: warning: {message}", file=sys.stderr, flush=True)


def did_you_mean(word: str, choices) -> str:
    """`` (did you mean 'x'?)`` for the closest of ``choices`` to a mistyped ``word``, else ``""``."""
    import difflib

    close = difflib.get_close_matches(word, list(choices), n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""
