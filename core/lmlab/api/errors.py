"""Re-export of the one user-facing error type (defined outside the API package so the CLI's fast
paths can catch it without importing torch)."""

from lmlab.errors import UserError

__all__ = ["UserError"]
