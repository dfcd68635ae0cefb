"""A drafter step compiled into few fused kernels (`dflash eval --compile-drafter`).

Why: inside a CUDA graph a kernel launch costs nothing, but each kernel still costs GPU time,
and a DFlash2 drafter step is a few hundred tiny ones (the convolutions around every sublayer,
the selector's walk). torch.compile fuses them; the static decode path (static_decode.py)
compiles its step before capturing it, so the graph records the compiled kernels.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import torch

COMPILE_BACKEND: str | Callable[..., Any] = "inductor"
"""What --compile-drafter compiles with. The CPU tests set "aot_eager": dynamo's same whole
graph, without the C++ build of inductor's kernels (15-20 s a compile on two cores, cold)."""


def compiled_step(step: Callable[[], Any]) -> tuple[Callable[[], Any], bool]:
    """(`step` compiled and already run once, True), or (`step` itself, False) with one
    warning when the compile fails: the uncompiled step drafts the same tokens, only slower."""

    def run() -> Any:
        # The loop decodes under no_grad; so does the compile, since a step compiled
        # with grad on would be compiled again (the grad mode is part of its guards).
        with torch.no_grad():
            return compiled()

    try:
        # fullgraph: a graph break would silently leave unfused pieces (and host round
        # trips that a capture refuses); better an error, and the uncompiled step.
        # dynamic=False: every shape of a step is fixed.
        compiled = torch.compile(step, backend=COMPILE_BACKEND, dynamic=False, fullgraph=True)
        # Every compiled step of the process (each drafter kind, capacity, draft mode and
        # temperature) is an entry of one code object's cache, whose default limit of 8
        # a benchmark of several drafters reaches; each entry is meant, none a recompile.
        with torch._dynamo.config.patch(recompile_limit=64):
            run()
    except torch.OutOfMemoryError:
        raise
    except Exception as e:
        print(
            f"dflash: compiling the drafter step failed ({_named(e)}); "
            "continuing with the uncompiled step",
            file=sys.stderr,
        )
        return step, False
    return run, True


def _named(e: BaseException) -> str:
    """`Type: message` of an exception and of the ones it was raised from, on one line and
    cut short: dynamo's messages run to dozens of lines (stacks, hints, links)."""
    parts = []
    cause: BaseException | None = e
    while cause is not None:
        parts.append(f"{type(cause).__name__}: {' '.join(str(cause).split())}")
        cause = cause.__cause__
    text = "; from ".join(parts)
    return text if len(text) <= 300 else text[:297] + "..."
