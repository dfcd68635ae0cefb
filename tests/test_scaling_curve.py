"""benchmarks/scaling_curve.py: the size points, the two extrapolations to a goal, the files."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
from benchmark_scripts import load_benchmark


def _bench() -> Any:
    return load_benchmark("scaling_curve")


def test_acceptance_and_tau_invert_each_other() -> None:
    sc = _bench()
    assert sc.tau_of_alpha(0.0, 16) == 1.0
    assert sc.tau_of_alpha(0.5, 2) == 1.5
    assert sc.tau_of_alpha(1.0, 16) == 16.0
    for tau in (1.1, 2.53, 4.0, 9.0, 15.5):
        assert sc.tau_of_alpha(sc.alpha_of_tau(tau, 16), 16) == pytest.approx(tau, abs=1e-9)
    with pytest.raises(ValueError, match="outside"):
        sc.alpha_of_tau(16.0, 16)


def test_points_on_either_model_are_extrapolated_exactly() -> None:
    sc = _bench()
    # tau exactly linear in log size: that model names the size; the other still grows.
    sizes = [1e4, 1e5, 1e6]
    taus = [1.5 + 0.5 * math.log10(x / 1e4) for x in sizes]
    p = sc.predict(sizes, taus, 4.0, 16)
    assert p["tau_log_linear"]["size_for_goal"] == pytest.approx(1e9, rel=1e-6)
    assert p["acceptance_logistic"]["slope"] > 0
    # Acceptance exactly logistic in log size: that model names the size.
    logit = [-0.5 + 0.4 * math.log(x) for x in sizes]
    taus = [sc.tau_of_alpha(1 / (1 + math.exp(-y)), 16) for y in logit]
    goal = 0.4 * math.log(2e6) - 0.5
    p = sc.predict(sizes, taus, sc.tau_of_alpha(1 / (1 + math.exp(-goal)), 16), 16)
    assert p["acceptance_logistic"]["size_for_goal"] == pytest.approx(2e6, rel=1e-6)
    for x in sizes:
        fit = p["acceptance_logistic"]
        assert sc.fitted("acceptance_logistic", fit, x, 16) == pytest.approx(taus[sizes.index(x)])


def test_no_prediction_without_two_sizes_or_growth() -> None:
    sc = _bench()
    for model in ("acceptance_logistic", "tau_log_linear"):
        assert "why_none" in sc.predict([1e4], [2.0], 4.0, 16)[model]
        assert "why_none" in sc.predict([1e4, 1e4], [2.0, 2.1], 4.0, 16)[model]
    assert "why_none" in sc.predict([1e4, 1e5], [2.0, 2.5], 16.0, 16)
    # A drafter that accepts nothing (tau 1) has no acceptance logit: that model skips it.
    p = sc.predict([1e3, 1e4, 1e5], [1.0, 2.0, 2.5], 4.0, 16)
    assert p["acceptance_logistic"]["points"] == 2 and p["tau_log_linear"]["points"] == 3
    assert "why_none" in sc.predict([1e3, 1e4], [1.0, 2.0], 4.0, 16)["acceptance_logistic"]
    shrinking = sc.predict([1e4, 1e5], [2.5, 2.0], 4.0, 16)
    assert "size_for_goal" not in shrinking["tau_log_linear"]
    assert "size_for_goal" not in shrinking["acceptance_logistic"]


def _report(path: Path, taus: dict[str, float]) -> Path:
    path.write_text(json.dumps({"sets": {k: {"tau": v} for k, v in taus.items()}}))
    return path


def test_bare_points_merge_by_label_and_write_every_file(tmp_path: Path) -> None:
    sc = _bench()
    small = _report(tmp_path / "small.json", {"gsm8k": 1.6, "mt-bench": 1.45})
    big_a = _report(tmp_path / "big_a.json", {"gsm8k": 2.53})
    big_b = _report(tmp_path / "big_b.json", {"mt-bench": 2.4})
    out = tmp_path / "scaling"
    argv = ["--point", f"10k=10199:{small}", "--point", f"100k=102927:{big_a}"]
    argv += ["--point", f"100k=102927:{big_b}", "--goal", "gsm8k=4.0", "--out", str(out)]
    assert sc.main(argv) == 0
    result = json.loads((out / "scaling.json").read_text())
    assert [q["tau"] for q in result["sizes"]] == [
        {"gsm8k": 1.6, "mt-bench": 1.45},
        {"gsm8k": 2.53, "mt-bench": 2.4},
    ]
    pred = result["predictions"]["gsm8k"]
    assert pred["points"] == 2
    # Both models grow with size: the goal lies beyond the largest point under each.
    assert pred["acceptance_logistic"]["size_for_goal"] > 102927
    assert pred["tau_log_linear"]["size_for_goal"] > pred["acceptance_logistic"]["size_for_goal"]
    assert "| gsm8k tau 4 | 2 |" in (out / "scaling.md").read_text()
    assert (out / "scaling.png").stat().st_size > 0


def test_a_run_or_a_point_is_required_and_a_point_is_checked(tmp_path: Path) -> None:
    with pytest.raises(SystemExit):
        _bench().main(["--out", str(tmp_path)])
    report = _report(tmp_path / "r.json", {"gsm8k": 2.0})
    for bad in ("10k:r.json", f"a=ten:{report}", f"a=10:{tmp_path / 'missing.json'}"):
        with pytest.raises(SystemExit, match="LABEL=TURNS:EVAL"):
            _bench().main(["--point", bad, "--out", str(tmp_path)])


def test_step_points_read_checkpoint_reports_not_their_logs(tmp_path: Path) -> None:
    """scaling_curve.sh writes step_<N>.log beside each step_<N>/ report."""
    sc = _bench()
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    (run / "checkpoints" / "LATEST").write_text("step_00000004\n")
    steps = tmp_path / "steps"
    for n, tau in ((2, 1.5), (4, 9.0)):
        (steps / f"step_{n:08d}").mkdir(parents=True)
        _report(steps / f"step_{n:08d}" / "eval.json", {"gsm8k": tau})
        (steps / f"step_{n:08d}.log").write_text("dflash eval: ...\n")
    rows = sc._step_points(steps, {"run": str(run), "tau": {"gsm8k": 2.0}})
    # The final checkpoint's point is the run's own report (2.0), not its step evaluation.
    assert rows == [{"step": 2, "tau": {"gsm8k": 1.5}}, {"step": 4, "tau": {"gsm8k": 2.0}}]
