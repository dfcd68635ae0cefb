"""The lineage in words: the model card's "Lineage" section and `dflash lineage show`."""

from __future__ import annotations

from typing import Any

from dflash_trainer.lineage.record import Lineage, PromptTurns, totals
from dflash_trainer.lineage.reuse import retrained
from dflash_trainer.lineage.served import merge_served

SECTION = "## Lineage"


def _n(x: Any) -> str:
    return f"{x:,}" if isinstance(x, int) else "-"


def _tau(served: dict[str, Any], name: str, t: str) -> str:
    row = (served.get(name) or {}).get(t) or {}
    tau, speedup = row.get("tau"), row.get("speedup")
    if not isinstance(tau, (int, float)):
        return "-"
    return f"{tau:.2f}" + (f" / {speedup:.2f}x" if isinstance(speedup, (int, float)) else "")


def _sources(data: dict[str, Any]) -> str:
    rows = data.get("sources") or {}
    if not rows:
        return str(data.get("source") or "-")
    return ", ".join(f"{k} {_n(v.get('documents', v.get('prompt_ids')))}" for k, v in rows.items())


def _retrained_lines(prompts: list[PromptTurns] | None) -> tuple[str, list[str]]:
    """What the summary may say of turns trained twice: the claim that none were (only when
    the prompt ids say so), and a line per continuation that trained on an earlier one's."""
    if prompts is None:  # not read: nothing claimed either way
        return "", []
    again = retrained(prompts)
    if not again:
        return "each continuation on assistant turns no earlier one trained on; ", []
    lines = [
        "Not every continuation trained on new turns only; the totals above count these "
        "turns once for each continuation that trained on them:",
        "",
    ]
    return "", [*lines, *(f"- {r.text()}." for r in again), ""]


def lineage_lines(lineage: Lineage | None, prompts: list[PromptTurns] | None) -> list[str]:
    """The card's "Lineage" section: cumulative training data, then one row per continuation.
    `prompts`: each continuation's prompt ids (record.read_prompts), which say whether a
    continuation trained again on turns of an earlier one; None when they were not read."""
    lines = [SECTION, ""]
    if not lineage or not lineage["continuations"]:
        return [*lines, "Not recorded: this drafter has no lineage.json.", ""]
    tot = totals(lineage)
    fresh, again = _retrained_lines(prompts)
    lines += [
        f"Trained in {tot['continuations']} continuation(s), {_n(tot['steps'])} optimizer steps "
        f"in all, on {_n(tot['documents'])} conversations: {_n(tot['assistant_turns'])} "
        f"assistant turns, {_n(tot['supervised_tokens'])} supervised tokens "
        f"({fresh}`lineage.json` lists them, `lineage_prompts.jsonl.gz` holds the prompt ids "
        "and their turns).",
        "",
        *again,
    ]
    if tot["sources"]:
        lines += ["Cumulative per source (what each continuation recorded of it):", ""]
        for name, row in tot["sources"].items():
            parts = [
                f"{_n(row[k])} {label}"
                for k, label in (
                    ("documents", "conversations"),
                    ("assistant_turns", "assistant turns"),
                    ("supervised_tokens", "supervised tokens"),
                    ("prompt_ids", "prompt ids"),
                )
                if k in row
            ]
            lines.append(f"- {name}: {', '.join(parts)}")
        lines.append("")
    lines += [
        "| # | date | start weights | steps | conversations | turns | supervised tokens "
        "| sources | weights | GSM8K t0 | MT-Bench t0 | HumanEval t0 | GSM8K t1 |",
        "|---:|---|---|---:|---:|---:|---:|---|---|---:|---:|---:|---:|",
    ]
    for c in lineage["continuations"]:
        data = c.get("data") or {}
        served = merge_served(c.get("evals") or [])
        start = (c.get("start") or {}).get("weights_sha256")
        result = (c.get("result") or {}).get("weights_sha256")
        lines.append(
            f"| {c['index']} | {str(c.get('date', '-'))[:10]} | {(start or 'scratch')[:12]} "
            f"| {_n(c.get('steps'))} | {_n(data.get('documents'))} "
            f"| {_n(data.get('assistant_turns'))} | {_n(data.get('supervised_tokens'))} "
            f"| {_sources(data)} | {(result or '-')[:12]} | {_tau(served, 'gsm8k', 't0')} "
            f"| {_tau(served, 'mt-bench', 't0')} | {_tau(served, 'humaneval', 't0')} "
            f"| {_tau(served, 'gsm8k', 't1')} |"
        )
    lines += ["", "Served numbers: tau / speedup over the target alone, as attached with "
              "`dflash lineage add-eval` after each continuation.", ""]  # fmt: skip
    return lines


def replace_section(card: str, lines: list[str]) -> str:
    """`card` with its Lineage section replaced (or inserted before "## Measured acceptance")."""
    new = "\n".join(lines)
    parts = card.split("\n")
    if SECTION in parts:
        a = parts.index(SECTION)
        b = next((i for i in range(a + 1, len(parts)) if parts[i].startswith("## ")), len(parts))
        return "\n".join([*parts[:a], new.rstrip("\n"), "", *parts[b:]])
    anchor = "## Measured acceptance"
    if anchor in parts:
        a = parts.index(anchor)
        return "\n".join([*parts[:a], new.rstrip("\n"), "", *parts[a:]])
    return card.rstrip("\n") + "\n\n" + new
