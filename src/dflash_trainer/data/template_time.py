"""A chat template is a program the model's files carry: its rendering is bounded in time
and in size.

Jinja's sandbox keeps a template from reaching Python's internals and caps one `range()` at
100,000, but two nested loops over such ranges run for hours: a damaged or hostile
`chat_template.jinja` would hang `data prepare`, `regenerate` or `eval` with no message. A
real template renders one conversation in milliseconds; one that uses `RENDER_CPU_SECONDS` of
CPU time is stopped with an error naming it. The bound is CPU time of this process
(ITIMER_VIRTUAL, its own signal: wall-clock timers of callers stay theirs), so a machine busy
with other work never trips it, and it applies on the main thread only (signals are
delivered there); elsewhere the template renders unbounded, as before.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from dflash_trainer.errors import DFlashError

RENDER_CPU_SECONDS = 20.0
MAX_RENDER_CHARS = 16 << 20
"""A conversation renders to at most this many characters (4M tokens and more: beyond the
longest context of any model); tokenizing more would take minutes to end in the same error."""


class TemplateTooSlow(DFlashError):
    """A chat template that runs for longer than any real one (not a per-record skip)."""


@contextmanager
def cpu_bound(seconds: float, what: str) -> Iterator[None]:
    """Raise TemplateTooSlow if the body uses more than `seconds` of CPU time."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def over(signum: int, frame: Any) -> None:
        raise TemplateTooSlow(
            f"{what} ran for more than {seconds:g} s of CPU time on one conversation (a loop "
            "that never ends?); fix the template (chat_template.jinja or tokenizer_config.json)"
        )

    previous = signal.signal(signal.SIGVTALRM, over)
    signal.setitimer(signal.ITIMER_VIRTUAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_VIRTUAL, 0)
        signal.signal(signal.SIGVTALRM, previous)


def render_chat(tokenizer: Any, messages: Any, **kwargs: Any) -> str:
    """`tokenizer.apply_chat_template(messages, tokenize=False, **kwargs)`, bounded in time."""
    with cpu_bound(RENDER_CPU_SECONDS, "the tokenizer's chat template"):
        text = tokenizer.apply_chat_template(messages, tokenize=False, **kwargs)
    if not isinstance(text, str):
        raise DFlashError(
            f"the tokenizer's chat template rendered {type(text).__name__}, not text; "
            "fix the template (chat_template.jinja or tokenizer_config.json)"
        )
    if len(text) > MAX_RENDER_CHARS:
        raise DFlashError(
            f"the tokenizer's chat template rendered {len(text):,} characters for one "
            f"conversation (at most {MAX_RENDER_CHARS:,}): a template or a message far longer "
            "than any model's context; fix the template or drop the message"
        )
    return text
