"""The project's user-facing error type: the CLI prints it without a traceback."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from dflash_trainer.config_fields import ConfigError


class DFlashError(RuntimeError):
    """A problem the user can fix; the message names it and the fix."""


CONTEXT_ATTR = "dflash_context"


@contextmanager
def about(what: str) -> Iterator[None]:
    """Name what was being read when a library error escapes (`while reading the tokenizer
    'x'`): the CLI's error boundary prints it, so an error raised deep inside transformers
    or safetensors still names the file the user gave. Our own errors pass unchanged."""
    try:
        yield
    except Exception as e:
        if not isinstance(e, DFlashError | ConfigError):
            _note(e, what)
        raise


def _note(e: BaseException, what: str) -> None:
    notes = list(getattr(e, CONTEXT_ATTR, []) or [])
    try:
        setattr(e, CONTEXT_ATTR, [*notes, what])
    except AttributeError:  # an exception type with __slots__: no note, same error
        pass
