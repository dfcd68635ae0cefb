"""Prepared data records its tokenizer; train, doctor and plan refuse another one's data.

Real tokenizers built in code and a tiny real llama target saved with its tokenizer:
- the manifest records the tokenizer (name, size, vocabulary hashes) and each split's id range;
- data of another tokenizer is refused by `dflash train`, `dflash doctor` and `dflash plan`,
  naming both tokenizers; data with ids past the target's vocabulary too (train used to crash
  in the embedding lookup);
- a directory without the record gets a warning, not a refusal.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import yaml
from test_data_support import sharegpt, tiny_tokenizer, write_jsonl
from trainer_utils import tiny_config, write_prepared, write_tiny_target

from dflash_trainer.cli import main
from dflash_trainer.config import Config, config_to_dict, replace
from dflash_trainer.data.prepare import prepare_dataset
from dflash_trainer.data.shards import MANIFEST
from dflash_trainer.data.tokenizer_check import findings, vocab_ids_sha256
from dflash_trainer.doctor.run import run_doctor
from dflash_trainer.errors import DFlashError
from dflash_trainer.train.trainer import Trainer

pytestmark = pytest.mark.usefixtures("one_thread")


def _target_with_tokenizer(path: Path, tok) -> Path:
    write_tiny_target(path, vocab_size=len(tok), initializer_range=0.02)  # llama's default
    tok.save_pretrained(path)
    return path


def _rows(n: int = 30) -> list[dict]:
    return [sharegpt(("human", f"question {i}?"), ("gpt", f"The answer is {i}.")) for i in range(n)]


@pytest.fixture(scope="module")
def setup(tmp_path_factory) -> tuple[Path, Config, Path, Path]:
    """(tmp, config whose target has the tiny tokenizer, data of that tokenizer, data of
    another tokenizer: the same plus one added token)."""
    tmp = tmp_path_factory.mktemp("tok")
    tok = tiny_tokenizer()
    target = _target_with_tokenizer(tmp / "target", tok)
    other = copy.deepcopy(tok)
    other.add_tokens(["<extra>"])
    other.save_pretrained(tmp / "other-tok")
    src = write_jsonl(tmp / "in.jsonl", _rows())
    mine = prepare_dataset(src, str(target), tmp / "mine", eval_fraction=0.1)
    theirs = prepare_dataset(src, str(tmp / "other-tok"), tmp / "theirs", eval_fraction=0.1)
    cfg = tiny_config(tmp, data={"train": str(mine)}, training={"max_steps": 1})
    cfg = replace(cfg, target={"name_or_path": str(target)})
    return tmp, cfg, mine, theirs


def test_the_manifest_records_the_tokenizer_and_the_id_range(setup):
    _, cfg, mine, _ = setup
    manifest = json.loads((mine / MANIFEST).read_text())
    rec = manifest["tokenizer"]
    tok = tiny_tokenizer()
    assert rec["vocab_size"] == len(tok) and rec["name"] == cfg.target.name_or_path
    assert rec["vocab_ids_sha256"] == vocab_ids_sha256(tok)
    lo, hi = manifest["splits"]["train"]["token_ids"]
    assert 0 <= lo <= hi < len(tok)
    # The same tokenizer, whatever its name: passes.
    found = findings(mine, manifest, "anything", len(tok), tok)
    assert [f[0] for f in found] == ["pass"]


def test_train_refuses_data_of_another_tokenizer_naming_both(setup):
    tmp, cfg, _, theirs = setup
    bad = replace(cfg, data={"train": str(theirs)}, run={"output_dir": str(tmp / "run-a")})
    with pytest.raises(DFlashError) as e:
        Trainer(bad, log_to_console=False)
    msg = str(e.value)
    assert "prepared with another tokenizer" in msg, msg
    assert str(tmp / "other-tok") in msg and cfg.target.name_or_path in msg
    good = replace(cfg, run={"output_dir": str(tmp / "run-b")})
    assert Trainer(good, log_to_console=False).train()["step"] == 1


def test_ids_outside_the_target_vocabulary_are_refused_by_train(setup, tmp_path):
    _, _, mine, _ = setup
    # The stock tiny target has 64 tokens; this data was prepared with ~400.
    cfg = tiny_config(tmp_path, data={"train": str(mine)})
    with pytest.raises(DFlashError, match=r"outside the target's vocabulary of 64 \(ids 0\.\.63\)"):
        Trainer(cfg, log_to_console=False)


def test_doctor_and_plan_refuse_another_tokenizer(setup, capsys):
    tmp, cfg, mine, theirs = setup
    checks = {c.id: c for c in run_doctor(cfg, data=theirs).checks}
    assert checks["data.tokenizer"].status == "fail"
    assert str(tmp / "other-tok") in checks["data.tokenizer"].message
    ok = {c.id: c for c in run_doctor(cfg, data=mine).checks}
    assert ok["data.tokenizer"].status == "pass"
    path = tmp / "cfg.yaml"
    path.write_text(yaml.safe_dump(config_to_dict(cfg)))
    capsys.readouterr()
    assert main(["plan", "--config", str(path), "--data", str(theirs)]) == 2
    err = capsys.readouterr().err
    assert "prepared with another tokenizer" in err and str(tmp / "other-tok") in err, err
    assert main(["plan", "--config", str(path), "--data", str(mine)]) == 0


def test_a_directory_without_the_record_is_a_warning_not_a_refusal(tmp_path, capsys):
    data = write_prepared(tmp_path / "old")  # a manifest as older versions (or hand) wrote it
    manifest = json.loads((data / MANIFEST).read_text())
    found = findings(data, manifest, "t", 64, None)
    assert [f[0] for f in found] == ["warn"] and "records no tokenizer" in found[0][1]
    assert [f[0] for f in findings(data, manifest, "t", 10, None)] == ["warn", "fail"]
    cfg = tiny_config(tmp_path, training={"max_steps": 1})
    capsys.readouterr()
    Trainer(cfg, log_to_console=False).train()
    assert "records no tokenizer" in capsys.readouterr().err
