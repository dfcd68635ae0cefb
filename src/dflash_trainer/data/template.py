"""Conversation -> `input_ids` + assistant `loss_mask`, with the target tokenizer's chat template.

What is supervised: for every assistant turn, the tokens the model generates in that turn as the
turn appears in the FINAL render of the whole conversation: its content and its end-of-turn token
(`<|im_end|>`: the drafter must learn to propose the stop), not the role header the template
writes before the content, and not the separator after the end-of-turn token (`\\n` in ChatML),
which the model never generates because generation stops at the end-of-turn token.

How the spans are found, without guessing from decoded text:
1. Render the whole conversation once (R) and tokenize it once with character offsets.
2. For assistant turn i, render the prefix before it with the generation prompt (G_i). The
   header ends where G_i stops agreeing with R. Using the longest common prefix instead of
   `len(G_i)` is what makes templates that rewrite turns work: a Qwen3-style template puts an
   empty `<think>` block in the generation prompt when thinking is off, but renders earlier
   assistant turns without it; the mask then starts where the final render really differs.
   The render of the messages before turn i (without generation prompt) must itself be a prefix
   of R, which proves that the earlier turns are rendered as in R; otherwise the record is
   skipped (`mask_mismatch`), never silently mis-masked.
3. The turn ends at the first end-of-turn token after the header. Which token closes a turn is
   read from the template itself, once, by rendering a probe conversation (ChatTemplate.probe).
   Content that contains the text of a control token the template uses (`<|im_end|>`,
   `<|im_start|>`) would break that structure, and would do so at inference too: such records
   are skipped (`special_token_in_content`).
4. Character positions map to tokens through the tokenizer's offsets. A token that straddles the
   header/content boundary (BPE merged the header's last character with the content's first) is
   supervised, and counted as the repair `boundary_token_merged`.

For templates without an end-of-turn control token, the turn runs to the start of the next
message, found as the length of the prefix render through turn i (which then must be a prefix
of R). A fast tokenizer (offsets) is required; every HF tokenizer loaded from tokenizer.json or
GGUF is one.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from dflash_trainer.data.formats import Skip
from dflash_trainer.data.records import Conversation
from dflash_trainer.data.template_time import TemplateTooSlow, render_chat
from dflash_trainer.errors import DFlashError

_PROBE_USER = "Probe question?"
_PROBE_ANSWER = "Probe answer 42."


@dataclass
class TemplatedDoc:
    input_ids: np.ndarray
    """int32 [T]"""
    loss_mask: np.ndarray
    """bool [T]"""
    repairs: list[str] = field(default_factory=list)


def _common_prefix_len(a: str, b: str) -> int:
    if b.startswith(a):
        return len(a)
    lo, hi = 0, min(len(a), len(b))
    while lo < hi:  # largest m with a[:m] == b[:m]; comparisons run in C
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


def special_ids(tokenizer: Any) -> set[int]:
    ids = set(tokenizer.all_special_ids)
    ids.update(i for i, tok in tokenizer.added_tokens_decoder.items() if tok.special)
    return ids


@dataclass(frozen=True)
class ChatTemplate:
    """A tokenizer's chat template plus what a probe render taught about its structure."""

    tokenizer: Any
    template_kwargs: dict[str, Any]
    """Extra template variables, e.g. {"enable_thinking": False} for Qwen3-style templates."""
    end_of_turn_id: int | None
    """The control token that closes an assistant turn, None if the template has none."""
    control_strings: tuple[str, ...]
    """Text of the control tokens the template emits; content must not contain them."""

    @classmethod
    def probe(cls, tokenizer: Any, **template_kwargs: Any) -> ChatTemplate:
        if getattr(tokenizer, "chat_template", None) is None:
            raise DFlashError(
                f"tokenizer {tokenizer.name_or_path!r} has no chat template; use the target's "
                "instruct tokenizer, or set tokenizer.chat_template before preparing data"
            )
        if not getattr(tokenizer, "is_fast", False):
            raise DFlashError(
                f"tokenizer {tokenizer.name_or_path!r} is a slow (Python) tokenizer; assistant "
                "masks need character offsets: load it with use_fast=True (tokenizer.json)"
            )
        chat = cls(tokenizer, dict(template_kwargs), None, ())
        probe = [
            {"role": "user", "content": _PROBE_USER},
            {"role": "assistant", "content": _PROBE_ANSWER},
        ]
        full = chat.render(probe)
        if _PROBE_ANSWER not in full:
            raise DFlashError("the chat template does not render assistant content verbatim")
        tail = full[full.rindex(_PROBE_ANSWER) + len(_PROBE_ANSWER) :]
        specials = special_ids(tokenizer)
        tail_ids = tokenizer(tail, add_special_tokens=False)["input_ids"]
        eot = next((t for t in tail_ids if t in specials), None)
        used = {t for t in tokenizer(full, add_special_tokens=False)["input_ids"] if t in specials}
        strings = tuple(sorted(tokenizer.convert_ids_to_tokens(sorted(used))))
        return cls(tokenizer, dict(template_kwargs), eot, strings)

    def render(
        self, messages: Sequence[dict[str, str]], add_generation_prompt: bool = False
    ) -> str:
        return render_chat(
            self.tokenizer,
            list(messages),
            add_generation_prompt=add_generation_prompt,
            **self.template_kwargs,
        )

    def prompt_ids(self, messages: Sequence[dict[str, str]]) -> list[int]:
        """Token ids of a generation prompt (used by regeneration)."""
        text = self.render(messages, add_generation_prompt=True)
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def spans(self, messages: Sequence[dict[str, str]]) -> tuple[str, list[tuple[int, int | None]]]:
        """The full render and, per assistant turn, (header end char, turn end char or None).

        The turn end is only known here for templates without an end-of-turn token; otherwise
        it is found at the token level after tokenization.
        """
        for m in messages:
            if any(s in m["content"] for s in self.control_strings):
                raise Skip("special_token_in_content")
        try:
            full = self.render(messages)
            spans: list[tuple[int, int | None]] = []
            for i, m in enumerate(messages):
                if m["role"] != "assistant":
                    continue
                with_prompt = self.render(messages[:i], add_generation_prompt=True)
                if full.startswith(with_prompt):
                    header_end = len(with_prompt)  # the common case; it also proves step 2
                else:
                    before = self.render(messages[:i])
                    if not full.startswith(before) or not with_prompt.startswith(before):
                        raise Skip("mask_mismatch")
                    header_end = _common_prefix_len(with_prompt, full)
                end: int | None = None
                if self.end_of_turn_id is None:
                    through = self.render(messages[: i + 1])
                    if not full.startswith(through):
                        raise Skip("mask_mismatch")
                    end = len(through)
                spans.append((header_end, end))
        except (Skip, TemplateTooSlow):  # a template too slow for one record is for all
            raise
        except Exception as e:  # jinja raises anything (TemplateError, TypeError, ...)
            raise Skip("template_error") from e
        return full, spans

    def tokenize(
        self,
        conversations: Sequence[Conversation],
        context: Sequence[frozenset[int]] | None = None,
    ) -> list[TemplatedDoc | Skip]:
        """Template and tokenize a batch (one batched tokenizer call: it uses all cores).

        `context[i]`: assistant turns of conversation i (numbered from 1) kept as context only,
        their mask left off (a drafter's lineage already trained on them)."""
        rendered: list[tuple[str, list[tuple[int, int | None]]] | Skip] = []
        for conv in conversations:
            try:
                rendered.append(self.spans(conv.messages))
            except Skip as s:
                rendered.append(s)
        texts = [r[0] for r in rendered if not isinstance(r, Skip)]
        enc: Any = {"input_ids": [], "offset_mapping": []}
        if texts:  # transformers fails on an empty batch
            enc = self.tokenizer(texts, add_special_tokens=False, return_offsets_mapping=True)
        out: list[TemplatedDoc | Skip] = []
        k = 0
        for i, r in enumerate(rendered):
            if isinstance(r, Skip):
                out.append(r)
                continue
            ids, offsets = enc["input_ids"][k], enc["offset_mapping"][k]
            k += 1
            try:
                out.append(self._masked(ids, offsets, r[1], context[i] if context else frozenset()))
            except Skip as s:
                out.append(s)
        return out

    def _masked(
        self,
        ids: list[int],
        offsets: list[tuple[int, int]],
        spans: list[tuple[int, int | None]],
        context: frozenset[int] = frozenset(),
    ) -> TemplatedDoc:
        ids_T = np.asarray(ids, dtype=np.int32)
        starts_T = np.asarray([o[0] for o in offsets], dtype=np.int64)
        ends_T = np.asarray([o[1] for o in offsets], dtype=np.int64)
        mask_T = np.zeros(len(ids), dtype=np.bool_)
        repairs: list[str] = []
        eot_pos = (
            np.flatnonzero(ids_T == self.end_of_turn_id)
            if self.end_of_turn_id is not None
            else None
        )
        prev_end = -1
        for turn, (header_end, turn_end) in enumerate(spans, 1):
            # The first token holding any character at or after the header end.
            first = int(np.searchsorted(ends_T, header_end, side="right"))
            if first >= len(ids) or first <= prev_end:
                raise Skip("mask_mismatch")
            if starts_T[first] < header_end:
                repairs.append("boundary_token_merged")
            if eot_pos is not None:
                after = eot_pos[eot_pos >= first]
                if not len(after):
                    raise Skip("mask_mismatch")
                last = int(after[0])  # inclusive: the end-of-turn token is supervised
            else:
                assert turn_end is not None
                last = int(np.searchsorted(starts_T, turn_end, side="left")) - 1
            if last < first:
                raise Skip("mask_mismatch")
            mask_T[first : last + 1] = turn not in context  # checked the same either way
            prev_end = last
        return TemplatedDoc(ids_T, mask_T, repairs)
