"""`dflash doctor --data` on data without documents: a failed check, not a traceback."""

from __future__ import annotations

from dflash_trainer.config import load_config
from dflash_trainer.doctor.run import run_doctor


def test_an_empty_jsonl_fails_data_documents_and_still_plans_memory(tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    cfg = load_config(recipe="qwen3-8b")
    report = run_doctor(cfg, data=empty, hardware="h200", use_tokenizer=False, env={})
    (docs,) = report.get("data.documents")
    assert docs.status == "fail" and "no documents" in docs.message
    # The memory check plans with the assumed documents instead of dividing by zero.
    memory = report.get("memory.colocated")
    assert memory and memory[0].status == "pass", report.format()
