"""The planner's FP8 target column: which weights it counts as FP8 (the converter's own
rule, checked against a real conversion), the FP8 matmul rate, the quantization
overhead, the precision of a calibrating run, and the CLI's two columns."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from test_planner import SEED_DATA, _fake_run
from transformers import AutoConfig, AutoModelForCausalLM

from dflash_trainer import cli
from dflash_trainer.config import load_config
from dflash_trainer.plan.flops import describe_target
from dflash_trainer.plan.hardware import get_hardware
from dflash_trainer.plan.planner import calibrate, predict
from dflash_trainer.plan.timing import FP8_QUANT_BYTES
from dflash_trainer.target.configs import load_target_config
from dflash_trainer.target.fp8 import quantize_linears
from dflash_trainer.target.model import decoder_layers

QWEN36 = "qwen3.6-27b"


def test_fp8_weights_are_the_ones_the_converter_converts():
    """Counted on meta modules with target/fp8.py's rule; converted for real on the same
    config: the same weights (a 72-wide MLP and 4 DeltaNet heads stay bf16)."""
    cfg = AutoConfig.for_model(
        "qwen3_5_text",
        hidden_size=64,
        intermediate_size=72,
        num_hidden_layers=2,
        layer_types=["linear_attention", "full_attention"],
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        linear_conv_kernel_dim=4,
        vocab_size=101,
    )
    tm = describe_target(cfg)
    model = AutoModelForCausalLM.from_config(cfg).to(torch.bfloat16)
    report = quantize_linears(model, decoder_layers(model), mode="rowwise", compiled=False)
    converted = sum(model.get_submodule(n).weight_fp8.numel() for n in report.converted)
    assert 0 < tm.decoder_fp8_params == converted < tm.decoder_linear_params
    assert sum(layer.fp8_linears for layer in tm.layers) == len(report.converted)
    inputs = sum(model.get_submodule(n).in_features for n in report.converted)
    assert sum(layer.fp8_inputs for layer in tm.layers) == inputs


def test_every_linear_of_qwen36_converts():
    tm = describe_target(load_target_config(load_config(recipe=QWEN36).target))
    assert tm.decoder_fp8_params == tm.decoder_linear_params
    assert all(layer.fp8_linears >= 4 for layer in tm.layers)


def test_fp8_column_pays_the_quantization_and_gains_only_on_the_linears():
    cfg = load_config(recipe=QWEN36)
    hw = get_hardware("h200")
    bf16 = predict(cfg, hw, gpus=2, data=SEED_DATA, target_precision="bf16")
    # FP8 at the bf16 rate and efficiency: only the quantization is left, so it is slower.
    same = dataclasses.replace(
        hw, fp8_tflops=hw.bf16_tflops, fp8_matmul_efficiency=hw.matmul_efficiency
    )
    slow = predict(cfg, same, gpus=2, data=SEED_DATA, target_precision="fp8")
    tm = describe_target(load_target_config(cfg.target))
    quant = (
        FP8_QUANT_BYTES
        * bf16.shape.target_padded_tokens
        * sum(layer.fp8_inputs for layer in tm.layers)
        / (hw.bandwidth_gbs * 1e9 * hw.bandwidth_efficiency)
    )
    assert slow.times.target == pytest.approx(bf16.times.target + quant, rel=1e-6)
    # An infinitely fast FP8 matmul leaves the linears only their weight read (1 byte each).
    fast = predict(
        cfg,
        dataclasses.replace(hw, fp8_tflops=1e12),
        gpus=2,
        data=SEED_DATA,
        target_precision="fp8",
    )
    linear_s = 2 * bf16.shape.target_padded_tokens * tm.decoder_linear_params
    linear_s /= hw.bf16_tflops * 1e12 * hw.matmul_efficiency
    read = bf16.shape.target_micro_batches * tm.decoder_linear_params
    read /= hw.bandwidth_gbs * 1e9 * hw.bandwidth_efficiency
    want = bf16.times.target - linear_s + read + quant
    assert fast.times.target == pytest.approx(want, rel=1e-6)
    # A lower FP8 efficiency (measured row-wise FP8 rate) slows the FP8 column only.
    lower = dataclasses.replace(hw, fp8_matmul_efficiency=0.5 * hw.matmul_efficiency)
    fp8 = predict(cfg, hw, gpus=2, data=SEED_DATA, target_precision="fp8")
    fp8_low = predict(cfg, lower, gpus=2, data=SEED_DATA, target_precision="fp8")
    assert fp8_low.times.target > fp8.times.target
    assert predict(cfg, lower, gpus=2, data=SEED_DATA).times.target == bf16.times.target


def test_the_configs_precision_is_the_default_column():
    cfg = load_config(recipe=QWEN36, overrides=["target.precision=fp8"])
    p = predict(cfg, "h200", gpus=2, data=SEED_DATA)
    assert p.target_precision == "fp8"
    assert (
        predict(cfg, "h200", gpus=2, data=SEED_DATA, target_precision="bf16").memory[0].peak_gb
        > p.memory[0].peak_gb + 20
    )


def test_a_run_with_an_fp8_target_calibrates_the_fp8_prediction(tmp_path, capsys):
    cfg = load_config(recipe=QWEN36, overrides=["target.precision=fp8"])
    hw = get_hardware("h200")
    base = predict(cfg, hw, gpus=2, data=SEED_DATA)
    run = _fake_run(tmp_path, cfg, 1.5 * base.times.target_side, base.times.drafter)
    cal = calibrate(run, hw, gpus=2, data=SEED_DATA)
    assert cal.target_precision == "fp8"
    assert cal.target_scale == pytest.approx(1.5, rel=1e-6)
    after = predict(cfg, hw, gpus=2, data=SEED_DATA, calibration=cal)
    assert after.times.target_side == pytest.approx(1.5 * base.times.target_side, rel=1e-6)
    argv = ["plan", "--recipe", QWEN36, "--gpus", "2", "--placement", "pairs"]
    argv += ["--samples", "902016", "--mean-tokens", "1500", "--calibrate", str(run)]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert "BF16 target" in out and "FP8 target" in out
    assert "records, fp8 target): target x" in out
    assert "1979 fp8 x" in out
    assert cli.main([*argv, "--json", "--target-precision", "fp8"]) == 0
    rec = json.loads(capsys.readouterr().out)["fp8"]
    assert rec["calibration"]["target_precision"] == "fp8"
    assert rec["run_days"] > 0
