"""Launch a worker script as N torchrun-style ranks (gloo, on this machine) for tests."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_ranks(
    script: Path, args: list[str], world: int, timeout_s: float
) -> tuple[list[int], list[str]]:
    """Run `script args...` as `world` ranks; their return codes and combined outputs.

    A rank still running after `timeout_s` (a hung collective) is killed, and the test
    fails saying so instead of waiting on the others forever.
    """
    port = free_port()
    procs = []
    for rank in range(world):
        env = {
            **os.environ,
            "RANK": str(rank),
            "WORLD_SIZE": str(world),
            "LOCAL_RANK": str(rank),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "OMP_NUM_THREADS": "1",
        }
        procs.append(
            subprocess.Popen(
                [sys.executable, str(script), *args],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    outs = []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=timeout_s)[0])
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        # What each rank printed before it was killed says where it stood.
        tails = [
            f"--- rank {r}:\n{(p.communicate()[0] or '')[-2000:]}" for r, p in enumerate(procs)
        ]
        pytest.fail(
            f"ranks did not finish within {timeout_s} s (a collective hung?)\n" + "\n".join(tails)
        )
    return [p.returncode for p in procs], outs
