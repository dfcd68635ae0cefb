"""The project's user-facing error type: the CLI prints it without a traceback."""

from __future__ import annotations


class DFlashError(RuntimeError):
    """A problem the user can fix; the message names it and the fix."""
