"""Lineage end to end on CPU: continuations that add up, recorded exactly (lineage_chain.py).

Two continuations after a drafter trained from scratch (one from a run directory, one from a
bf16 z-lab export): the record's hashes match the files, replaying a continuation from its
record reproduces its weights bit for bit, and no continuation reuses a prompt id (the data
commands leave them out, counted; the trainer refuses data that holds one).
"""

from __future__ import annotations

import gzip
import json
import math
from pathlib import Path

import pytest
import torch
from lineage_chain import STEPS, Chain, conversation
from test_data_support import write_jsonl

from dflash_trainer.cli import main
from dflash_trainer.config import config_from_dict, replace
from dflash_trainer.data.prepare import read_record_ids
from dflash_trainer.errors import DFlashError
from dflash_trainer.formats.drafter_io import load_drafter
from dflash_trainer.lineage.cli import drafter_weights_sha256
from dflash_trainer.lineage.record import (
    read_lineage,
    read_prompts,
    recorded_ids,
    totals,
)
from dflash_trainer.train.trainer import Trainer

pytestmark = pytest.mark.usefixtures("one_thread")


def test_each_drafter_records_its_whole_lineage_and_the_hashes_match(chain: Chain) -> None:
    run2 = chain.runs[2]
    lineage = read_lineage(run2)
    assert lineage is not None
    conts = lineage["continuations"]
    assert [c["index"] for c in conts] == [0, 1, 2]
    # Inherited, not rewritten: the first two records are those of run1's export.
    exported = read_lineage(chain.export)
    assert exported is not None and conts[:2] == exported["continuations"]
    # Each result hash is the hash of the weights that run wrote.
    for c, run in zip(conts, chain.runs, strict=True):
        assert c["result"]["weights_sha256"] == drafter_weights_sha256(run / "drafter")
        assert c["steps"] == STEPS and c["config"]["run"]["output_dir"] == str(run)
    # Each start is the drafter it continued: scratch, run0's weights, the bf16 export's.
    assert conts[0]["start"]["weights_sha256"] is None
    assert conts[1]["start"]["weights_sha256"] == conts[0]["result"]["weights_sha256"]
    export_hash = drafter_weights_sha256(chain.export)
    assert conts[1]["exports"] == [
        {**conts[1]["exports"][0], "format": "zlab", "weights_sha256": export_hash}
    ]
    assert conts[1]["exports"][0]["dtype"] == "bfloat16"
    assert conts[2]["start"]["weights_sha256"] == export_hash
    assert export_hash != conts[1]["result"]["weights_sha256"]  # a cast is a new hash
    assert main(["lineage", "verify", str(run2)]) == 0
    assert main(["lineage", "verify", str(chain.export)]) == 0


def test_the_record_holds_the_data_each_continuation_trained_on(chain: Chain) -> None:
    lineage = read_lineage(chain.runs[2])
    assert lineage is not None
    prompts = read_prompts(chain.runs[2])
    for c, prep, ids in zip(lineage["continuations"], chain.prepared, prompts, strict=True):
        trained = read_record_ids(prep)
        assert trained is not None and ids == trained
        manifest = json.loads((prep / "manifest.json").read_text())
        train = manifest["splits"]["train"]
        data = c["data"]
        assert data["documents"] == train["documents"] == len(ids)
        assert data["supervised_tokens"] == train["supervised_tokens"]
        assert data["assistant_turns"] == sum(ids.values())
        assert data["sources"]["mix"]["assistant_turns"] == data["assistant_turns"]
        assert data["prompt_ids"]["count"] == len(ids)
    # Conversation i has two answers when i % 3 == 0: the turns are counted, not assumed.
    assert prompts[0] == {f"mix/c{i}": 2 if i % 3 == 0 else 1 for i in range(12)}
    assert set(prompts[1]) == {f"mix/c{i}" for i in range(12, 24)}
    assert set(prompts[2]) == {f"mix/c{i}" for i in range(24, 36)}
    tot = totals(lineage)
    assert tot["continuations"] == 3 and tot["steps"] == 3 * STEPS and tot["documents"] == 36
    assert tot["assistant_turns"] == 36 + 12
    # The export's model card states it cumulatively.
    card = (chain.export / "README.md").read_text()
    assert "## Lineage" in card and f"Trained in 2 continuation(s), {2 * STEPS} optimizer" in card
    assert f"on 24 conversations: {sum(map(len, prompts[:2])) + 8} assistant turns" in card


def test_a_continuation_never_reuses_a_recorded_prompt_id(chain: Chain, tmp_path: Path) -> None:
    # The data commands left the recorded prompts out and counted them.
    assert chain.excluded == [0, 12, 24]
    recorded = recorded_ids(chain.runs[2])
    assert len(recorded) == 36
    # The trainer refuses data holding a recorded id (run1's data, from run2's weights).
    cfg = config_from_dict(json.loads(json.dumps(_record(chain, 1)["config"])))
    cfg = replace(cfg, run={"output_dir": str(tmp_path / "again")})
    cfg = replace(cfg, drafter={"init_from": str(chain.runs[2])})
    with pytest.raises(DFlashError, match=r"12 of its 12 training prompts .*--exclude-lineage"):
        Trainer(cfg, log_to_console=False)
    # `dflash data prompts` leaves them out before its caps, counted per source.
    src = write_jsonl(tmp_path / "c.jsonl", [conversation(i) for i in range(40)])
    for row in (json.loads(x) for x in src.read_text().splitlines()):
        assert row["id"].startswith("mix/")
    plain = write_jsonl(
        tmp_path / "plain.jsonl",
        [{**conversation(i), "id": f"c{i}"} for i in range(40)],
    )
    mix = tmp_path / "mix.yaml"
    mix.write_text(f"sources:\n  - name: mix\n    path: {plain}\n    messages: messages\n")
    out = tmp_path / "prompts.jsonl"
    argv = ["data", "prompts", "--sources", str(mix), "--out", str(out)]
    argv += ["--decontam-evals", "none", "--exclude-lineage", str(chain.runs[2])]
    assert main(argv) == 0
    ids = {json.loads(x)["id"] for x in out.read_text().splitlines()}
    assert ids == {f"mix/c{i}" for i in range(36, 40)}
    side = json.loads(out.with_name("prompts.jsonl.sources.json").read_text())
    assert side["excluded_by_lineage"]["excluded"] == 36
    assert side["sources"][0]["in_lineage"] == 36 and side["sources"][0]["written"] == 4


def test_replaying_a_continuation_from_its_record_reproduces_its_weights(
    chain: Chain, tmp_path: Path
) -> None:
    rec = _record(chain, 1)
    cfg = config_from_dict(json.loads(json.dumps(rec["config"])))
    cfg = replace(cfg, run={"output_dir": str(tmp_path / "replay")})
    assert drafter_weights_sha256(cfg.drafter.init_from) == rec["start"]["weights_sha256"]
    Trainer(cfg, log_to_console=False).train()
    replay = drafter_weights_sha256(tmp_path / "replay")
    assert replay == rec["result"]["weights_sha256"]
    _, a, _ = load_drafter(tmp_path / "replay")
    _, b, _ = load_drafter(chain.runs[1])
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_damaged_or_foreign_lineages_are_refused(chain: Chain, tmp_path: Path) -> None:
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(chain.export, copy)
    # Prompt ids edited: their hash no longer matches lineage.json.
    path = copy / "lineage_prompts.jsonl.gz"
    with gzip.open(path, "rt") as f:
        rows = [json.loads(x) for x in f]
    rows[0]["prompts"]["mix/c99"] = 1
    with gzip.open(path, "wt") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    with pytest.raises(DFlashError, match="do not match the count and sha256"):
        recorded_ids(copy)
    # A lineage next to other weights: refused by verify, by export and as a start.
    foreign = tmp_path / "foreign"
    shutil.copytree(chain.runs[0] / "drafter", foreign)
    shutil.copy(chain.runs[2] / "drafter" / "lineage.json", foreign / "lineage.json")
    shutil.copy(chain.runs[2] / "drafter" / "lineage_prompts.jsonl.gz", foreign)
    assert main(["lineage", "verify", str(foreign)]) == 2
    assert main(["export", str(foreign), "--to", "zlab", str(tmp_path / "x")]) == 2
    assert main(["lineage", "show", str(chain.runs[2])]) == 0


def _record(chain: Chain, index: int) -> dict:
    lineage = read_lineage(chain.runs[2])
    assert lineage is not None
    return dict(lineage["continuations"][index])


def test_the_lineage_curve_reads_the_recorded_jobs(chain: Chain, tmp_path: Path) -> None:
    from benchmark_scripts import load_benchmark

    mod = load_benchmark("lineage_curve")
    # Block 4: the default goals (GSM8K 4.0) are out of any such drafter's reach, said so.
    argv = [str(chain.runs[2]), "--out", str(tmp_path / "far"), "--block-size", "4"]
    assert mod.main(argv) == 0
    far = json.loads((tmp_path / "far.json").read_text())
    assert "outside (1, 4)" in far["fits"]["assistant_turns"]["gsm8k"]["why_none"]
    argv = [str(chain.runs[2]), "--out", str(tmp_path / "curve"), "--block-size", "4"]
    assert mod.main([*argv, "--goal", "gsm8k=1.5", "--goal", "mt-bench=1.2"]) == 0
    report = json.loads((tmp_path / "curve.json").read_text())
    assert (tmp_path / "curve.png").stat().st_size > 1000
    # One point per job, at the cumulative data of the record and the tau of its report.
    lineage = read_lineage(chain.runs[2])
    assert lineage is not None
    turns = [c["data"]["assistant_turns"] for c in lineage["continuations"]]
    pts = report["points"]
    assert [p["assistant_turns"] for p in pts] == [sum(turns[: i + 1]) for i in range(3)]
    for p, ev in zip(pts, chain.evals, strict=True):
        served = json.loads((ev / "eval.json").read_text())["sets"]
        assert p["tau"] == {"gsm8k": served["gsm8k"]["tau"], "mt-bench": served["mt-bench"]["tau"]}
    fit = report["fits"]["assistant_turns"]["gsm8k"]["tau_log_linear"]
    assert fit["points"] == 3
    xs = [math.log(p["assistant_turns"]) for p in pts]
    ys = [p["tau"]["gsm8k"] for p in pts]
    mx, my = sum(xs) / 3, sum(ys) / 3
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True))
    slope /= sum((x - mx) ** 2 for x in xs)
    assert fit["slope"] == pytest.approx(slope, abs=1e-9)
    assert ("size_for_goal" in fit) == (slope > 0)
    # A drafter trained from scratch on less data: one more point of the fits, marked.
    first = chain.evals[0] / "eval.json"
    goals = ["--goal", "gsm8k=1.5", "--goal", "mt-bench=1.2"]
    assert mod.main([*argv, *goals, "--reference", f"small=1,10,{first}"]) == 0
    pts = json.loads((tmp_path / "curve.json").read_text())["points"]
    assert pts[0]["reference"] == "small" and pts[0]["assistant_turns"] == 1
    report = json.loads((tmp_path / "curve.json").read_text())
    assert report["fits"]["assistant_turns"]["gsm8k"]["tau_log_linear"]["points"] == 4
    for bad in ("small", "small=1,x,r.json", f"small=1,2,{tmp_path / 'none.json'}"):
        with pytest.raises(SystemExit, match="--reference"):
            mod.main([*argv, "--reference", bad])


def test_init_records_a_drafter_trained_before_lineages(chain: Chain, tmp_path: Path) -> None:
    import shutil

    d = tmp_path / "published"
    shutil.copytree(chain.export, d, ignore=shutil.ignore_patterns("lineage*"))
    prompts = write_jsonl(tmp_path / "p.jsonl", [conversation(i) for i in range(5)])
    ids = write_jsonl(tmp_path / "ids.jsonl", [{"id": f"synth/synth-{i:07d}"} for i in range(3)])
    argv = ["lineage", "init", str(d), "--prompts", str(prompts), "--prompts", str(ids)]
    assert main([*argv, "--steps", "7", "--supervised-tokens", "100"]) == 0
    assert main([*argv, "--steps", "7"]) == 2  # only starts a lineage
    lineage = read_lineage(d)
    assert lineage is not None
    (c,) = lineage["continuations"]
    assert c["result"]["weights_sha256"] == drafter_weights_sha256(d)
    assert c["data"]["sources"] == {"mix": {"prompt_ids": 5}, "synth": {"prompt_ids": 3}}
    assert c["data"]["assistant_turns"] == 5 + 2  # c0 and c3 have two answers
    assert recorded_ids(d) == {f"mix/c{i}" for i in range(5)} | {
        f"synth/synth-{i:07d}" for i in range(3)
    }
    assert main(["lineage", "verify", str(d)]) == 0


def test_init_rerun_with_the_same_arguments_is_a_no_op_and_other_ones_are_refused(
    chain: Chain, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import shutil

    d = tmp_path / "published"
    shutil.copytree(chain.export, d, ignore=shutil.ignore_patterns("lineage*"))
    prompts = write_jsonl(tmp_path / "p.jsonl", [conversation(i) for i in range(3)])
    argv = ["lineage", "init", str(d), "--prompts", str(prompts), "--steps", "7"]
    assert main([*argv, "--note", "from the training log"]) == 0
    files = {p.name: p.read_bytes() for p in d.glob("lineage*")}
    import hashlib
    import json

    recorded = json.loads(files["lineage.json"])["continuations"][0]["data"]["prompt_files"]
    # The files by name and content, never the scratch path they lay at.
    assert recorded == [
        {"name": "p.jsonl", "sha256": hashlib.sha256(prompts.read_bytes()).hexdigest()}
    ]
    assert str(tmp_path) not in files["lineage.json"].decode()
    capsys.readouterr()
    assert main([*argv, "--note", "from the training log"]) == 0  # a script run twice
    out, err = capsys.readouterr()
    assert "already records this training; nothing to do" in out, out + err
    assert {p.name: p.read_bytes() for p in d.glob("lineage*")} == files  # not rewritten
    for other, says in (
        (["--steps", "8", "--note", "from the training log"], "steps"),
        (["--steps", "7", "--note", "a guess"], "data.note"),
    ):
        assert main([*argv[:-2], *other]) == 2
        err = " ".join(capsys.readouterr().err.split())
        assert "already has a lineage.json that records other training" in err, err
        assert f"({says} differ from these arguments)" in err, err
    extra = write_jsonl(tmp_path / "q.jsonl", [conversation(i) for i in range(4)])
    assert main([*argv, "--prompts", str(extra), "--note", "from the training log"]) == 2
    assert "data.prompt_files" in capsys.readouterr().err
    assert {p.name: p.read_bytes() for p in d.glob("lineage*")} == files


def test_add_eval_reads_only_regular_reports_of_finite_numbers(
    chain: Chain, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A report is a regular file (a FIFO is refused at once, never waited on) whose served
    numbers are finite; nothing is attached, and nothing rewritten, when one is refused."""
    import os
    import shutil
    import time

    copy = tmp_path / "copy"
    shutil.copytree(chain.runs[0] / "drafter", copy)
    before = (copy / "lineage.json").read_bytes()
    report = json.loads((chain.evals[0] / "eval.json").read_text())
    bad = []
    for name, value in (("nan", float("nan")), ("text", "1.5"), ("inf", float("inf"))):
        rep = json.loads(json.dumps(report))
        rep["sets"]["gsm8k"]["tau"] = value
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps(rep))  # NaN and Infinity, as Python's json writes them
        bad.append((path, "sets.gsm8k.tau"))
    os.mkfifo(tmp_path / "fifo.json")
    bad.append((tmp_path / "fifo.json", "FIFO"))
    (tmp_path / "deep.json").write_text('{"sets": ' + "[" * 5000 + "]" * 5000 + "}")
    bad.append((tmp_path / "deep.json", "nested more than"))
    capsys.readouterr()
    for path, needle in bad:
        t0 = time.perf_counter()
        assert main(["lineage", "add-eval", str(copy), str(path)]) == 2
        err = capsys.readouterr().err
        assert needle in err and "Traceback" not in err, err
        assert time.perf_counter() - t0 < 5
    assert (copy / "lineage.json").read_bytes() == before


@pytest.mark.parametrize("damage", ["truncate", "flip", "deep", "shape"])
def test_damaged_lineage_files_are_user_errors(chain: Chain, tmp_path: Path, damage: str) -> None:
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(chain.runs[1] / "drafter", copy)
    prompts, lineage = copy / "lineage_prompts.jsonl.gz", copy / "lineage.json"
    if damage == "truncate":
        prompts.write_bytes(prompts.read_bytes()[:30])
    elif damage == "flip":
        data = bytearray(prompts.read_bytes())
        data[len(data) // 2] ^= 0xFF
        prompts.write_bytes(bytes(data))
    elif damage == "deep":
        lineage.write_text('{"format": ' + "[" * 100_000 + "]" * 100_000 + "}")
    else:
        record = json.loads(lineage.read_text())
        record["continuations"][0]["steps"] = "many"
        lineage.write_text(json.dumps(record))
    needle = {"truncate": "not a readable gzip", "flip": "gzip|do not match",
              "deep": "nested more than", "shape": "continuation 0 is damaged"}[damage]  # fmt: skip
    with pytest.raises(DFlashError, match=needle):
        read_prompts(copy)
    assert main(["lineage", "verify", str(copy)]) == 2


@pytest.mark.parametrize("name", ["lineage.json", "lineage_prompts.jsonl.gz"])
def test_lineage_files_that_link_out_of_the_drafter_are_refused(
    chain: Chain, tmp_path: Path, name: str
) -> None:
    import shutil

    copy, elsewhere = tmp_path / "copy", tmp_path / "elsewhere"
    shutil.copytree(chain.runs[1] / "drafter", copy)
    elsewhere.mkdir()
    (copy / name).rename(elsewhere / name)  # the very same bytes, outside the drafter
    (copy / name).symlink_to(elsewhere / name)
    with pytest.raises(DFlashError, match="leads outside"):
        read_prompts(copy)
    assert main(["lineage", "verify", str(copy)]) == 2
    (copy / name).unlink()
    (copy / name).symlink_to(Path("sub") / name)  # a link that stays inside is read
    (copy / "sub").mkdir()
    (elsewhere / name).rename(copy / "sub" / name)
    assert main(["lineage", "verify", str(copy)]) == 0


def test_an_export_exported_again_keeps_its_recipe_from_the_lineage(
    chain: Chain, tmp_path: Path
) -> None:
    """A z-lab export has no meta.json; exported again (a card with served numbers added, or
    another layout), its card names the recipe, data and steps its last continuation recorded."""
    again = tmp_path / "again"
    assert main(["export", str(chain.export), "--to", "zlab", str(again)]) == 0
    card = (again / "README.md").read_text()
    lineage = read_lineage(chain.export)
    assert lineage is not None
    last = lineage["continuations"][-1]
    assert "Not recorded in the drafter's meta.json" not in card
    assert f"Training step: {last['steps']}" in card
    assert f'"lr": {last["config"]["training"]["lr"]}' in card
    assert main(["lineage", "verify", str(again)]) == 0
