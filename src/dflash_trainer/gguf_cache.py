"""A GGUF target unpacked once into plain Hugging Face files, so later loads skip the GGUF parse.

transformers reads a GGUF's config, its tokenizer and its weights by parsing the file's metadata
each time: for the SmolLM2 asset (49k tokens and 48k merges stored as GGUF arrays) about 10 s of
CPU per parse, so a command that loads the target's config, tokenizer and weights spent half a
minute before its first step, and `dflash doctor` on the default recipe 20 s. The first load of
each part writes it here as `save_pretrained` writes it (`config/`, `tokenizer/`, `model/`); every
later load reads those plain files in a fraction of a second. The weights are kept in float32,
exactly as dequantised, so a later load in any dtype casts the same values a GGUF load would.

Where: `$DFLASH_CACHE_DIR`, else `$XDG_CACHE_HOME/dflash-trainer`, else `~/.cache/dflash-trainer`;
`DFLASH_CACHE_DIR=off` loads every GGUF directly. An entry is named by the file's resolved path,
size, modification time and a hash of its first and last MiB, so an edited or replaced GGUF gets a
new entry instead of the old one's parts. Each part is written whole or not at all
(`atomic_directory`): a load killed midway leaves no half part, and two processes building the
same part never both parse the GGUF: the second waits for the first (a kernel lock per part)
and reads what it wrote. A cached part is checked as any model directory a user
names (`check_model_files`, and `check_model_weights` for the weights). A cache that cannot be
written, or a part that fails those checks or no longer loads (damaged by hand), never stops a
load: the GGUF is read directly, and a damaged part is rebuilt from it.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import shutil
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar, cast

from dflash_trainer.atomic_dir import atomic_directory
from dflash_trainer.errors import DFlashError
from dflash_trainer.model_dir_check import check_model_files

T = TypeVar("T")

ENV = "DFLASH_CACHE_DIR"
_EDGE = 1 << 20  # bytes hashed at each end of the file: its header and its last tensor
WEIGHTS_MAX_GGUF_BYTES = 2 << 30
"""Weights are cached only for a GGUF up to this size: dequantised to float32 a 4-bit file
grows about eightfold, which is disk and load-time memory a large model should not spend."""


def cache_root() -> Path | None:
    """The cache's directory, or None when `DFLASH_CACHE_DIR=off`."""
    env = os.environ.get(ENV)
    if env is not None:
        return None if env.strip().lower() in ("off", "0", "") else Path(env).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "dflash-trainer"


def entry_key(path: Path) -> str:
    """What names a GGUF's entry: the same bytes at the same place, told apart cheaply."""
    st = path.stat()
    h = hashlib.sha256(f"{os.path.realpath(path)}\0{st.st_size}\0{st.st_mtime_ns}".encode())
    with path.open("rb") as f:
        h.update(f.read(_EDGE))
        f.seek(max(0, st.st_size - _EDGE))
        h.update(f.read(_EDGE))
    return h.hexdigest()[:32]


def is_local(directory: str, gguf: str) -> bool:
    """Whether `directory/gguf` is a file here (a hub id's GGUF is loaded as before)."""
    return (Path(directory) / gguf).is_file()


def part_dir(directory: str, gguf: str, part: str) -> Path | None:
    """Where part `part` of `directory/gguf` is cached, or None when there is no cache."""
    root = cache_root()
    path = Path(directory) / gguf
    if root is None or not path.is_file():
        return None
    return root / "gguf" / entry_key(path) / part


def _quiet(_msg: str) -> None:
    """`atomic_directory`'s note on a stale temporary part it removes: not the user's file."""


def cached(
    directory: str,
    gguf: str,
    part: str,
    from_gguf: Callable[[], T],
    from_plain: Callable[[Path], T],
    save: Callable[[T, Path], object],
) -> T:
    """`part` of a GGUF: read from its cached plain files, else from the GGUF and then cached."""
    try:
        where = part_dir(directory, gguf, part)
    except OSError:  # a cache directory this user may not read: as if there were none
        where = None
    if where is None:
        return from_gguf()
    with _one_builder(where):  # a second process waits here, then reads what the first wrote
        found = _read(where, gguf, part, from_plain)
        if found is not _MISSING:
            return cast(T, found)
        obj = from_gguf()
        try:
            with atomic_directory(where, log=_quiet) as tmp:
                save(obj, tmp)
        except (OSError, DFlashError):  # read-only home, full disk, a concurrent writer won
            return obj
    print(f"[dflash] kept the {part} read from {gguf} as plain files in {where}: later loads "
          f"read those (set {ENV}=off to read the GGUF each time)", file=sys.stderr)  # fmt: skip
    return obj


_MISSING = object()
BUILD_WAIT_S = 900.0
"""How long a load waits for another process building the same part (a build takes under a
minute for SmolLM2's weights) before it reads the GGUF itself."""


def _read(where: Path, gguf: str, part: str, from_plain: Callable[[Path], T]) -> object:
    """The cached part, or _MISSING when there is none or it does not load (then removed)."""
    try:
        if not where.is_dir():
            return _MISSING
    except OSError:
        return _MISSING
    try:
        # Read as any model directory a user names is: no FIFO or device among its files,
        # the counts and sizes of its config.json within a real model's.
        check_model_files(where, f"the cached {part} of {gguf}")
        return from_plain(where)
    except Exception as e:  # any failure of a cached copy: the GGUF itself can serve
        print(
            f"[dflash] cached {part} of {gguf} does not load ({e}); rebuilding it "
            f"from the GGUF: {where}",
            file=sys.stderr,
        )
        shutil.rmtree(where, ignore_errors=True)
        return _MISSING


@contextlib.contextmanager
def _one_builder(where: Path) -> Iterator[None]:
    """Held while a process reads or builds `where`: ranks of one torchrun (or test workers)
    loading the same GGUF parse it once, not once each. The lock is the kernel's (flock): it
    goes with its process, so a killed builder never leaves it held. Where it cannot be taken
    (no cache directory to write, a builder stuck for BUILD_WAIT_S), the load goes on
    without it, as before."""
    try:
        where.parent.mkdir(parents=True, exist_ok=True)
        flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW  # a link in its place is not followed
        fd = os.open(where.parent / f".{where.name}.lock", flags, 0o600)
    except OSError:
        yield
        return
    try:
        deadline = time.monotonic() + BUILD_WAIT_S
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except OSError:
                if time.monotonic() > deadline:
                    break
                time.sleep(0.2)
        yield
    finally:
        os.close(fd)  # releases the lock


def strip_gguf_marks(model: Any) -> Any:
    """A model loaded from a GGUF holds plain dequantised tensors, but transformers still marks
    it quantized and refuses to save it: the marks go (a cached load has none either)."""
    model.hf_quantizer = None
    model.is_quantized = False
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    return model


def named(obj: Any, directory: str) -> Any:
    """A part read from the cache named as a GGUF load names it (its directory): the name is
    recorded with prepared data and runs, which must not depend on whether the cache served."""
    if hasattr(obj, "config"):  # a model: its own name and its config's
        obj.config._name_or_path = directory
    if hasattr(obj, "_name_or_path"):  # a config
        obj._name_or_path = directory
    else:
        obj.name_or_path = directory
    return obj


def _auto_part(directory: str, gguf: str, part: str, auto: Any) -> Any:
    """A config or a tokenizer: `auto` (an Auto class) reads both forms and saves itself."""
    return cached(
        directory,
        gguf,
        part,
        lambda: auto.from_pretrained(directory, gguf_file=gguf),
        lambda p: named(auto.from_pretrained(p), directory),
        lambda obj, p: obj.save_pretrained(p),
    )


def config(directory: str, gguf: str) -> Any:
    from transformers import AutoConfig

    return _auto_part(directory, gguf, "config", AutoConfig)


def tokenizer(directory: str, gguf: str) -> Any:
    from transformers import AutoTokenizer

    return _auto_part(directory, gguf, "tokenizer", AutoTokenizer)


def causal_lm(directory: str, gguf: str, dtype: Any, **kwargs: Any) -> Any:
    """The dequantised model in `dtype`; `kwargs` go to `from_pretrained` (attention choice).
    Loaded in float32 from the GGUF when it is cached, so the copy serves every dtype."""
    import torch
    from transformers import AutoModelForCausalLM, GgufConfig

    from dflash_trainer.formats.safetensors_check import check_model_weights

    def from_gguf(as_dtype: Any) -> Any:
        # Dense weights always: with the optional `kernels` package transformers would keep
        # them packed in GGUF blocks, which the taps, the FP8 path and a save cannot use.
        m = AutoModelForCausalLM.from_pretrained(
            directory,
            gguf_file=gguf,
            dtype=as_dtype,
            quantization_config=GgufConfig(dequantize=True),
            **kwargs,
        )
        return strip_gguf_marks(m)

    def plain_model(p: Path) -> Any:
        check_model_weights(p)  # headers within the files, the config matching the weights
        return AutoModelForCausalLM.from_pretrained(p, dtype=dtype, **kwargs)

    if (Path(directory) / gguf).stat().st_size > WEIGHTS_MAX_GGUF_BYTES:
        return from_gguf(dtype)
    model = cached(
        directory,
        gguf,
        "model",
        lambda: from_gguf(torch.float32),
        lambda p: named(plain_model(p), directory),
        lambda m, p: m.save_pretrained(p),
    )
    return model.to(dtype)
