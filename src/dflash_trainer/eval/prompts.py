"""Evaluation prompt sets: GSM8K, MT-Bench, HumanEval (offline assets) and JSONL files.

A prompt is a conversation: a list of `{"role", "content"}` messages. Every user message
that no assistant message follows is a turn to answer; the evaluator answers them in order
and feeds each generated answer back as the assistant turn before the next one (MT-Bench's
second turn is asked after the model's own first answer). Messages given with an assistant
reply are history.

Wording: GSM8K gets the usual step-by-step / boxed-answer instruction of math evals (the
instruction shapes the answer's length and style, hence acceptance, so published DFlash
numbers use it too); HumanEval asks for the function completed in a Python code block.
"""

from __future__ import annotations

import io
import json
import random
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dflash_trainer.assets import AssetNotFound, asset_path
from dflash_trainer.errors import DFlashError
from dflash_trainer.input_files import check_regular, open_input

Messages = list[dict[str, str]]

BUILTIN_SETS = ("gsm8k", "mt-bench", "humaneval")
GSM8K_SUFFIX = "\nPlease reason step by step, and put your final answer within \\boxed{}."
HUMANEVAL_INSTRUCTION = (
    "Complete this Python function. Answer with the whole function in one ```python code block."
)
_TEXT_KEYS = ("prompt", "question", "instruction", "input", "text", "query")


@dataclass(frozen=True)
class Prompt:
    id: str
    """The source's own id (GSM8K: line index, MT-Bench: question_id, HumanEval: task_id)."""
    messages: Messages


@dataclass(frozen=True)
class PromptSet:
    name: str
    prompts: list[Prompt]
    total: int
    """Prompts in the source before --max-samples."""


def _read_jsonl(path: Path) -> Iterator[tuple[int, Any]]:
    with io.TextIOWrapper(open_input(path, "prompts file"), encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                yield lineno, json.loads(line)
            except json.JSONDecodeError as e:
                raise DFlashError(f"{path}:{lineno}: not valid JSON ({e})") from e


def _asset(name: str) -> Path:
    try:
        return asset_path(name)
    except AssetNotFound as e:
        raise DFlashError(str(e)) from e


def _gsm8k() -> list[Prompt]:
    return [
        Prompt(str(i), [{"role": "user", "content": row["question"] + GSM8K_SUFFIX}])
        for i, (_, row) in enumerate(_read_jsonl(_asset("gsm8k")))
    ]


def _mt_bench() -> list[Prompt]:
    return [
        Prompt(str(row["question_id"]), [{"role": "user", "content": t} for t in row["turns"]])
        for _, row in _read_jsonl(_asset("mt-bench"))
    ]


def _humaneval() -> list[Prompt]:
    out = []
    for _, row in _read_jsonl(_asset("humaneval")):
        text = f"{HUMANEVAL_INSTRUCTION}\n```python\n{row['prompt']}```"
        out.append(Prompt(row["task_id"], [{"role": "user", "content": text}]))
    return out


def _messages_of(value: Any, where: str) -> Messages:
    """One JSONL value -> messages: a string, {"messages": [...]}, {"turns": [...]} or a text key."""
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if not isinstance(value, dict):
        raise DFlashError(f"{where}: expected a string or an object, got {type(value).__name__}")
    if "messages" in value:
        msgs = value["messages"]
        ok = isinstance(msgs, list) and all(
            isinstance(m, dict) and isinstance(m.get("content"), str) and "role" in m for m in msgs
        )
        if not ok or not msgs:
            raise DFlashError(f"{where}: 'messages' must be a list of {{role, content}} objects")
        return [{"role": str(m["role"]), "content": m["content"]} for m in msgs]
    if "turns" in value:
        turns = value["turns"]
        if not isinstance(turns, list) or not turns or not all(isinstance(t, str) for t in turns):
            raise DFlashError(f"{where}: 'turns' must be a non-empty list of strings")
        return [{"role": "user", "content": t} for t in turns]
    for key in _TEXT_KEYS:
        if isinstance(value.get(key), str):
            return [{"role": "user", "content": value[key]}]
    raise DFlashError(
        f"{where}: no prompt found; give a string or an object with 'messages', 'turns' or one "
        f"of {list(_TEXT_KEYS)}"
    )


def _jsonl(path: Path) -> list[Prompt]:
    out = []
    for lineno, value in _read_jsonl(path):
        messages = _messages_of(value, f"{path}:{lineno}")
        if not any(m["role"] == "user" for m in messages):
            raise DFlashError(f"{path}:{lineno}: the conversation has no user message to answer")
        rid = value.get("id", value.get("question_id")) if isinstance(value, dict) else None
        out.append(Prompt(str(rid if rid is not None else lineno), messages))
    return out


def _open_turns(messages: list[dict[str, str]]) -> int:
    """User turns not followed by an assistant answer: the turns `dflash eval` decodes."""
    nxt = [m["role"] for m in messages[1:]] + [None]
    return sum(m["role"] == "user" and r != "assistant" for m, r in zip(messages, nxt))


def load_prompt_set(name: str, max_samples: int | None = None, seed: int = 0) -> PromptSet:
    """A built-in set by name or a JSONL (optionally .gz) file; a seeded subset of max_samples.

    The subset keeps the source order, so a smaller max_samples with the same seed does not
    give a prefix of a larger one, but the same arguments always give the same prompts.
    """
    if name == "gsm8k":
        prompts = _gsm8k()
    elif name == "mt-bench":
        prompts = _mt_bench()
    elif name == "humaneval":
        prompts = _humaneval()
    else:
        path = Path(name).expanduser()
        if path.exists() and not path.is_file():
            check_regular(path, "prompt set")  # a directory, a FIFO, a device: said as such
        if not path.is_file():
            raise DFlashError(
                f"prompt set {name!r}: not a built-in set ({', '.join(BUILTIN_SETS)}) and no "
                "such file; give a JSONL file of prompts or a built-in name"
            )
        prompts = _jsonl(path)
        if not any(_open_turns(p.messages) for p in prompts):
            # Without this a run measures nothing and reports tau nan with exit status 0.
            raise DFlashError(
                f"prompt set {name!r}: no user turn left to answer ("
                + (
                    "the file holds no prompts"
                    if not prompts
                    else "every user turn is already followed by an assistant answer"
                )
                + "); give prompts whose last turn is the user's"
            )
    total = len(prompts)
    if max_samples is not None and max_samples < total:
        keep = sorted(random.Random(seed).sample(range(total), max_samples))
        prompts = [prompts[i] for i in keep]
    return PromptSet(name, prompts, total)


def set_label(name: str) -> str:
    """A short label for reports: the set name, or a JSONL file's stem."""
    return name if name in BUILTIN_SETS else Path(name).stem
