"""Fuzzing of damaged run directories: no traceback, no hang, nothing lost.

A real finished run is built once (a tiny llama target with its tokenizer, data prepared by
`dflash data prepare`, 4 steps of `dflash train` with checkpoints at steps 2 and 4, and a
`dflash eval` report of its drafter). Each case copies the run, damages one of its files or
directories (cut short, zeroed, a byte flipped, replaced by garbage, by nothing, by JSON of
the wrong shape, by a huge or a deeply nested JSON value, by a directory, a FIFO, a link to
another file of the run or to a file outside it, or a link loop) and runs every command that
reads a run directory: `lineage show|verify|add-eval`, `export`, `eval --drafter`, `plan
--calibrate`, `doctor --config RUN/config.yaml` (doctor takes no run directory: its config),
`plot`, a fresh `train` into it (which must refuse a used directory) and `train --resume`.

Each command must end cleanly (success, or an error paragraph with exit status 1 or 2 and no
traceback) within its time limit, and must leave alone what it does not write: the run's file
tree is compared before and after each command (files by content, links by target), allowing
only the paths that command writes (`--resume` rewrites the run's own outputs, `add-eval` the
lineage files), and the files outside the run that a link points to must never change.

The cases are the damages that an earlier round found harmful (REGRESSIONS), then the damages
of every entry of the run in a fixed shuffled order (~500), then again at other cut and flip
positions; DFLASH_RUN_FUZZ_CASES sets how many of those run (default 6: under a minute on two
cores with the build; 600 for a hostile round). Counts are printed at the end of the module and
written to <pytest basetemp>/run_dir_fuzz_counts.json.
"""

from __future__ import annotations

import contextlib
import faulthandler
import fnmatch
import hashlib
import json
import os
import random
import shutil
import stat
import sys
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml
from fuzz_support import go_offline, run_cli, show
from lineage_chain import base_config, conversation, write_target
from test_data_support import write_jsonl

from dflash_trainer.cli import main
from dflash_trainer.errors import DFlashError

pytestmark = pytest.mark.slow  # the commands load the real default target

CASES = int(os.environ.get("DFLASH_RUN_FUZZ_CASES", "6"))
"""Sampled cases beyond the regressions (REGRESSIONS)."""
WALL_SECONDS = 20
"""One command's wall-clock limit (it takes well under 2 s here): past it, a hang."""
COUNTS: Counter[str] = Counter()
FAILURES: list[str] = []
SLOWEST: list[str] = []

FILE_DAMAGES = [
    *("truncate", "zero", "flip", "garbage", "empty", "wrong_json", "huge_json", "deep_json"),
    *("directory", "fifo", "link_inside", "link_outside", "link_loop"),
]
DIR_DAMAGES = ["empty_dir", "garbage", "empty", "fifo", "link_outside", "link_loop"]
GARBAGE = b"\xff\xfe\x00 not what this file holds {[\x00\x01" * 37
WRONG = {  # valid JSON whose fields every reader of a run meets with the wrong type or range
    "step": -1, "sha256": {"drafter.safetensors": 1}, "format": "dflash-lineage", "version": "1",
    "continuations": [{"index": 0, "steps": -5, "data": [], "evals": [{"served": 3}]}],
    "target": "x", "drafter": [], "training": {"seed": "x"}, "position": {"epoch": "0"},
    "hidden_size": -1, "loss": float("nan"), "lr": None, "slot_acc": ["a"], "history": 5,
    "sets": {"x": {"tau": "1"}}, "param_groups": {}, "weight_map": [],
}  # fmt: skip

# What each command may write in the run directory (fnmatch patterns of paths relative to
# it); everything else must be left as it was. The lock file comes and goes with a trainer.
ALWAYS = [".dflash-lock"]
RESUME_WRITES = [
    *("config.yaml", ".config.yaml.*", "run_info.json", ".run_info.json.*"),
    *("run_info.json.damaged-*", "metrics.jsonl", ".metrics.jsonl.*", "tb", "tb/*"),
    *("plots", "plots/*", "drafter", "drafter/*", ".drafter.*"),
    *("checkpoints", "checkpoints/LATEST", "checkpoints/.LATEST.tmp"),
    *("checkpoints/step_00000004", "checkpoints/step_00000004/*", "checkpoints/.step_00000004.*"),
]
LINEAGE_WRITES = ["drafter/lineage.json", "drafter/lineage_prompts.jsonl.gz", "drafter/.lineage*"]


@dataclass
class Pristine:
    root: Path
    run: Path
    config: Path
    prompts: Path
    report: Path


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread() -> Iterator[None]:
    """Tiny models on shared cores: a second torch thread only contends (conftest.one_thread,
    for the module-scoped build too)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def warm_default_target() -> None:
    """A config that names no target gets the default (the SmolLM2 GGUF asset): its config and
    tokenizer are unpacked into the cache once here, a one-time cost of about 20 s of CPU that
    the per-command limit below would otherwise take for a hang."""
    from dflash_trainer.config import TargetConfig
    from dflash_trainer.data.loading import load_tokenizer, tokenizer_spec
    from dflash_trainer.target.configs import load_target_config

    with contextlib.suppress(DFlashError, FileNotFoundError):  # not installed: commands say so
        load_target_config(TargetConfig())
        load_tokenizer(tokenizer_spec(TargetConfig()))


@pytest.fixture(scope="module")
def pristine(tmp_path_factory, one_torch_thread) -> Pristine:
    warm_default_target()
    root = tmp_path_factory.mktemp("pristine")
    target = write_target(root / "target")
    src = write_jsonl(root / "a.jsonl", [conversation(i) for i in range(12)])
    argv = ["data", "prepare", "--input", str(src), "--tokenizer", str(target)]
    assert main([*argv, "--out", str(root / "prep"), "--eval-fraction", "0"]) == 0
    cfg = base_config(root, target, root / "prep", root / "run")
    cfg["training"].update(max_steps=4, checkpoint_every=2, log_every=1)
    config = root / "run.yaml"
    config.write_text(yaml.safe_dump(cfg))
    assert main(["train", "--config", str(config), "--skip-doctor"]) == 0
    prompts = root / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": "hello how can you help"}) + "\n")
    p = Pristine(root, root / "run", config, prompts, root / "eval")
    assert main([*_eval_argv(p, p.run), "--out-dir", str(p.report)]) == 0
    return p


def _eval_argv(p: Pristine, run: Path) -> list[str]:
    tiny = ["--max-samples", "1", "--max-new-tokens", "8", "--device", "cpu"]
    return ["eval", "--drafter", str(run), "--prompts", str(p.prompts), *tiny, "--no-baseline",
            "--no-progress"]  # fmt: skip


def commands(p: Pristine, run: Path, scratch: Path) -> list[tuple[str, list[str], list[str]]]:
    """(name, argv, what it may write in the run), readers first: `--resume` goes last, since
    it repairs or rewrites what the others must meet damaged."""
    fresh = ["train", "--config", str(p.config)]
    return [
        ("lineage show", ["lineage", "show", str(run)], []),
        ("lineage verify", ["lineage", "verify", str(run)], []),
        (
            "export",
            ["export", str(run), "--to", "zlab", str(scratch / "x"), "--dtype", "float32"],
            [],
        ),
        ("eval", [*_eval_argv(p, run), "--out-dir", str(scratch / "eval")], []),
        ("plan", ["plan", "--config", str(p.config), "--calibrate", str(run)], []),
        ("doctor", ["doctor", "--config", str(run / "config.yaml")], []),
        ("plot", ["plot", str(run), "--out", str(scratch / "plots")], []),
        ("fresh train", [*fresh, f"run.output_dir={run}", "--skip-doctor"], []),
        ("lineage add-eval", ["lineage", "add-eval", str(run), str(p.report)], LINEAGE_WRITES),
        ("resume", ["train", "--resume", str(run)], RESUME_WRITES),
    ]


# ----------------------------------------------------------------------------- damage


def damage(victim: Path, kind: str, where: float, outside: Path) -> None:
    """Damage `victim` (a file or a directory of the run) in place; `where` in [0, 1) picks
    the cut or the flipped byte."""
    was_dir = victim.is_dir()
    data = victim.read_bytes() if victim.is_file() else b""
    if kind in ("truncate", "zero", "flip"):
        if kind == "truncate":
            data = data[: int(len(data) * where)]
        elif kind == "zero":
            data = bytes(len(data))
        elif data:
            i = int(len(data) * where)
            data = data[:i] + bytes([data[i] ^ (1 << int(where * 64) % 8)]) + data[i + 1 :]
        victim.write_bytes(data)
        return
    if was_dir:
        shutil.rmtree(victim)
    else:
        victim.unlink()
    if kind == "empty_dir":
        victim.mkdir()
    elif kind == "directory":
        victim.mkdir()
        (victim / "inside").write_bytes(GARBAGE)
    elif kind == "fifo":
        os.mkfifo(victim)
    elif kind == "link_outside":
        victim.symlink_to(outside / ("dir" if was_dir else "secret.json"))
    elif kind == "link_inside":  # another file of the run, in the victim's place
        others = sorted(p for p in victim.parent.iterdir() if p.is_file() and not p.is_symlink())
        victim.symlink_to(others[int(where * len(others))] if others else victim.parent)
    elif kind == "link_loop":
        victim.symlink_to(victim.name)
    else:
        victim.write_bytes(_content(kind, where))


def _content(kind: str, where: float) -> bytes:
    if kind == "garbage":
        return GARBAGE
    if kind == "wrong_json":  # half the time the object above, else a value of no shape
        return json.dumps([WRONG, WRONG, None, [], "step_00000002"][int(where * 5)]).encode()
    if kind == "empty":
        return b""
    if kind == "huge_json":  # a valid JSON value of 12 MB: big, and of no expected shape
        return json.dumps({"step": [{"step": i, "loss": "x"} for i in range(600_000)]}).encode()
    assert kind == "deep_json", kind
    return b'{"step": ' + b"[" * 200_000 + b"]" * 200_000 + b"}"


def write_outside(root: Path) -> Path:
    """Files outside the run that damaged links point to (they must never change)."""
    outside = root / "outside"
    (outside / "dir").mkdir(parents=True)
    secret = {"step": 1, "sha256": {"x": "y"}, "format": "dflash-lineage", "loss": 1.0}
    (outside / "secret.json").write_text(json.dumps(secret))
    (outside / "dir" / "secret.json").write_text(json.dumps(secret))
    return outside


def victims(run: Path) -> list[str]:
    """Every file and directory of the run (relative paths), the run itself aside."""
    out = []
    for dirpath, dirnames, filenames in os.walk(run):
        for name in dirnames + filenames:
            out.append(str((Path(dirpath) / name).relative_to(run)))
    return sorted(out)


REGRESSIONS = [
    # What the first hostile round of this fuzzer found (a hang, a traceback or data loss
    # each): always run, before the sampled cases.
    ("run_info.json", "fifo"),
    ("checkpoints/step_00000004/checksums.json", "fifo"),
    ("checkpoints/step_00000004/checksums.json", "deep_json"),
    ("metrics.jsonl", "deep_json"),
    ("drafter/lineage_prompts.jsonl.gz", "truncate"),
    ("drafter/drafter.safetensors", "link_loop"),
    ("checkpoints/step_00000004", "link_loop"),
    ("config.yaml", "empty"),
    ("tb", "link_outside"),
    ("plots/tau.png", "link_outside"),
]


def cases(run: Path, n: int) -> Iterator[tuple[str, str, float]]:
    """(victim, damage, where): the regressions, then `n` sampled: every damage of every
    entry in a fixed shuffled order, then again at other positions."""
    rng = random.Random(0)
    for v, k in REGRESSIONS:
        yield v, k, rng.random()
    pairs = []
    for v in victims(run):
        kinds = DIR_DAMAGES if (run / v).is_dir() else FILE_DAMAGES
        pairs += [(v, k) for k in kinds if (v, k) not in REGRESSIONS]
    rng.shuffle(pairs)
    for i in range(n):
        v, k = pairs[i % len(pairs)]
        yield v, k, rng.random()


# ------------------------------------------------------------------------ data loss


def snapshot(root: Path) -> dict[str, tuple[str, str]]:
    """Every entry under `root` (links not followed): its kind and content (sha256 of a file,
    target of a link)."""
    out: dict[str, tuple[str, str]] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            p = Path(dirpath) / name
            mode = os.lstat(p).st_mode
            if stat.S_ISLNK(mode):
                out[str(p.relative_to(root))] = ("link", os.readlink(p))
            elif stat.S_ISREG(mode):
                digest = hashlib.sha256(p.read_bytes()).hexdigest()
                out[str(p.relative_to(root))] = ("file", digest)
            else:
                kind = "dir" if stat.S_ISDIR(mode) else "fifo" if stat.S_ISFIFO(mode) else "other"
                out[str(p.relative_to(root))] = (kind, "")
    return out


def lost(before: dict, after: dict, allowed: list[str]) -> list[str]:
    """Entries changed, removed or added outside the `allowed` patterns. A file or link
    moved (its content now at another path, e.g. a damaged file kept aside) is not lost; a
    directory is judged by its entries."""
    out = []
    moved = {v for k, v in after.items() if before.get(k) != v and v[0] != "dir"}
    for path in sorted(before.keys() | after.keys()):
        if before.get(path) == after.get(path):
            continue
        if any(fnmatch.fnmatchcase(path, pat) for pat in [*ALWAYS, *allowed]):
            continue
        if path not in after and (before[path] in moved or before[path][0] == "dir"):
            continue
        what = "removed" if path not in after else "added" if path not in before else "changed"
        out.append(f"{path} {what}")
    return out


# ------------------------------------------------------------------------------ test


@pytest.fixture(scope="module", autouse=True)
def report_counts(request, tmp_path_factory) -> Iterator[None]:
    yield
    out = tmp_path_factory.getbasetemp() / "run_dir_fuzz_counts.json"
    keys = ("cases", "tried", "clean", "tracebacks", "hangs", "data_loss")
    counts = {k: COUNTS[k] for k in keys}
    counts["of which"] = {k: v for k, v in sorted(COUNTS.items()) if k not in counts}
    out.write_text(json.dumps({**counts, "slowest": SLOWEST, "failures": FAILURES[:50]}, indent=1))
    show(request, f"run dir fuzz: {json.dumps(counts)} ({out})")


@pytest.fixture(autouse=True)
def offline(monkeypatch) -> None:
    go_offline(monkeypatch)


def run_case(p: Pristine, scratch: Path, victim: str, kind: str, where: float, capsys) -> None:
    """One damaged copy of the run through every command; counts and failures recorded."""
    run = scratch / "run"
    shutil.copytree(p.run, run, symlinks=True)
    outside = write_outside(scratch)
    damage(run / victim, kind, where, outside)
    outside_before = snapshot(outside)
    case = f"{victim} <- {kind}@{where:.3f}"
    COUNTS["cases"] += 1
    for name, argv, writes in commands(p, run, scratch):
        before = snapshot(run)
        COUNTS["tried"] += 1
        t0 = time.perf_counter()
        out = run_cli(argv, capsys, WALL_SECONDS)
        ms = int(1000 * (time.perf_counter() - t0))
        if ms > COUNTS["max_ms"]:
            COUNTS["max_ms"] = ms
            SLOWEST[:] = [f"{name} on {case}"]
        problems = []
        if out.problem is not None:
            COUNTS["hangs" if out.problem == "hang" else "tracebacks"] += 1
            tail = out.text.strip().splitlines()[-1:] or [repr(out.error)]
            problems.append(f"{out.problem}: {tail[0][:300]}")
        elif name == "fresh train" and out.rc != 2:
            problems.append(f"a fresh run into a used directory was not refused (exit {out.rc})")
        gone = lost(before, snapshot(run), writes) + lost(outside_before, snapshot(outside), [])
        if gone:
            COUNTS["data_loss"] += 1
            problems.append(f"data loss: {'; '.join(gone[:5])}")
        if problems:
            FAILURES.append(f"{case}: {name}: {' | '.join(problems)}")
            if out.problem in ("traceback", "escaped", "exit"):
                FAILURES.append(out.text[-1500:] if out.text else repr(out.error))
        else:
            COUNTS["clean"] += 1
            COUNTS[f"{name}: exit {out.rc}"] += 1
    shutil.rmtree(scratch, ignore_errors=True)


def test_damaged_run_directories_end_cleanly(pristine, tmp_path, capsys):
    capsys.readouterr()
    for i, (victim, kind, where) in enumerate(cases(pristine.run, CASES)):
        # A hang that no signal interrupts (a blocking read in native code) still ends the
        # test, with every thread's stack, instead of stalling the suite.
        faulthandler.dump_traceback_later(12 * WALL_SECONDS, exit=True, file=sys.__stderr__)
        try:
            run_case(pristine, tmp_path / f"case{i}", victim, kind, where, capsys)
        finally:
            faulthandler.cancel_dump_traceback_later()
    assert not FAILURES, "\n".join(FAILURES[:40])
