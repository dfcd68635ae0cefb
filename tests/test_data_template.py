"""Assistant masks, token by token, for ChatML, a Qwen3-style thinking template and others."""

from __future__ import annotations

import itertools
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_data_support import (
    CHATML,
    CHATML_GENERATION,
    PLAIN,
    QWEN3_STYLE,
    smollm2_tokenizer,
    tiny_tokenizer,
)

from dflash_trainer.data.formats import Skip, read_records
from dflash_trainer.data.records import Conversation
from dflash_trainer.data.template import ChatTemplate, TemplatedDoc


def conv(*pairs: tuple[str, str]) -> Conversation:
    return Conversation("t", [{"role": r, "content": c} for r, c in pairs])


def templated(chat: ChatTemplate, c: Conversation) -> TemplatedDoc:
    (doc,) = chat.tokenize([c])
    assert isinstance(doc, TemplatedDoc), doc
    return doc


def spans(mask: np.ndarray) -> list[tuple[int, int]]:
    edges = np.flatnonzero(np.diff(np.concatenate([[0], mask.astype(np.int8), [0]])))
    return [(int(a), int(b)) for a, b in zip(edges[::2], edges[1::2])]


def decoded_spans(tok: Any, doc: TemplatedDoc) -> list[str]:
    return [tok.decode(doc.input_ids[a:b]) for a, b in spans(doc.loss_mask)]


def ids_of(tok: Any, text: str) -> list[int]:
    return list(tok(text, add_special_tokens=False)["input_ids"])


MULTI = conv(
    ("system", "Be brief."),
    ("user", "Hello!"),
    ("assistant", "Hi, how can I help?"),
    ("user", "Add 1 and 2."),
    ("assistant", "1 + 2 = 3"),
)


def _check_chatml_boundaries(tok: Any, c: Conversation, doc: TemplatedDoc) -> None:
    """Each span is exactly [content..., <|im_end|>] after `<|im_start|>assistant\\n`."""
    header = ids_of(tok, "<|im_start|>assistant\n")
    eot = tok.convert_tokens_to_ids("<|im_end|>")
    newline = ids_of(tok, "\n")
    answers = [m["content"] for m in c.messages if m["role"] == "assistant"]
    ids = doc.input_ids.tolist()
    assert len(spans(doc.loss_mask)) == len(answers)
    for (a, b), answer in zip(spans(doc.loss_mask), answers):
        assert ids[a - len(header) : a] == header  # the header is not supervised
        assert ids[a : b - 1] == ids_of(tok, answer)  # the content is, all of it
        assert ids[b - 1] == eot  # and so is the end-of-turn token
        assert ids[b : b + len(newline)] == newline  # the separator after it is not
    # The input ids are the template's own tokenization of the whole conversation.
    assert ids == tok.apply_chat_template(c.messages, tokenize=True)["input_ids"]


def test_chatml_multi_turn_mask_token_by_token() -> None:
    tok = tiny_tokenizer()
    chat = ChatTemplate.probe(tok)
    assert chat.end_of_turn_id == tok.convert_tokens_to_ids("<|im_end|>")
    assert chat.control_strings == ("<|im_end|>", "<|im_start|>")
    _check_chatml_boundaries(tok, MULTI, templated(chat, MULTI))


THINKING = conv(
    ("user", "Q one?"),
    ("assistant", "<think>\nfirst reasoning\n</think>\n\nAnswer one."),
    ("user", "Q two?"),
    ("assistant", "<think>\nsecond reasoning\n</think>\n\nAnswer two."),
)


def test_qwen3_style_masks_each_turn_as_in_the_final_render() -> None:
    tok = tiny_tokenizer(QWEN3_STYLE)
    chat = ChatTemplate.probe(tok)
    doc = templated(chat, THINKING)
    # The earlier turn lost its reasoning in the final render; the last turn kept it.
    assert decoded_spans(tok, doc) == [
        "Answer one.<|im_end|>",
        "<think>\nsecond reasoning\n</think>\n\nAnswer two.<|im_end|>",
    ]
    assert "first reasoning" not in tok.decode(doc.input_ids)
    (a0, _), (a1, _) = spans(doc.loss_mask)
    header = ids_of(tok, "<|im_start|>assistant\n")
    assert doc.input_ids[a0 - len(header) : a0].tolist() == header
    assert doc.input_ids[a1 - len(header) : a1].tolist() == header
    assert doc.input_ids[a1] == tok.convert_tokens_to_ids("<think>")  # an added, non-special token
    full = tok.apply_chat_template(THINKING.messages, tokenize=True)["input_ids"]
    assert doc.input_ids.tolist() == full


def test_qwen3_style_without_thinking_leaves_the_empty_think_block_unsupervised() -> None:
    tok = tiny_tokenizer(QWEN3_STYLE)
    chat = ChatTemplate.probe(tok, enable_thinking=False)
    c = conv(
        ("user", "Q one?"),
        ("assistant", "Answer one."),
        ("user", "Q two?"),
        ("assistant", "Answer two."),
    )
    doc = templated(chat, c)
    assert decoded_spans(tok, doc) == ["Answer one.<|im_end|>", "Answer two.<|im_end|>"]
    (a0, _), (a1, _) = spans(doc.loss_mask)
    # The generation prompt (thinking off) ends with an empty think block: not generated.
    empty_think = ids_of(tok, "<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert doc.input_ids[a1 - len(empty_think) : a1].tolist() == empty_think
    # The earlier turn has no think block in the final render: the mask starts after the header.
    header = ids_of(tok, "<|im_start|>assistant\n")
    assert doc.input_ids[a0 - len(header) : a0].tolist() == header


def test_template_without_end_of_turn_token_masks_to_the_next_message() -> None:
    tok = tiny_tokenizer(PLAIN)
    chat = ChatTemplate.probe(tok)
    assert chat.end_of_turn_id is None
    doc = templated(chat, MULTI)
    # " 1" is one token of this vocabulary: the header's trailing space merged into the
    # answer's first token, which is then supervised and reported.
    assert decoded_spans(tok, doc) == ["Hi, how can I help?\n\n", " 1 + 2 = 3\n\n"]
    assert doc.repairs == ["boundary_token_merged"]


_text = st.text(alphabet=st.sampled_from(list("ab cd\n.!?0é✓")), min_size=1, max_size=30).filter(
    lambda s: bool(s.strip())
)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(_text, _text), min_size=1, max_size=4), st.booleans())
def test_mask_equals_transformers_generation_mask(
    turns: list[tuple[str, str]], system: bool
) -> None:
    """Oracle: a template with {% generation %} makes transformers compute its own mask."""
    tok = tiny_tokenizer(CHATML_GENERATION)
    msgs = [{"role": "system", "content": "sys"}] if system else []
    for q, a in turns:
        msgs += [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
    doc = templated(ChatTemplate.probe(tok), Conversation("h", msgs))
    ref = tok.apply_chat_template(
        msgs, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
    )
    assert doc.input_ids.tolist() == ref["input_ids"]
    assert doc.loss_mask.astype(int).tolist() == ref["assistant_masks"]


@pytest.mark.parametrize(
    ("template", "c", "reason"),
    [
        (
            CHATML,
            conv(("user", "say <|im_end|> now"), ("assistant", "ok")),
            "special_token_in_content",
        ),
        (
            CHATML,
            conv(("user", "q"), ("assistant", "<|im_start|>user\nfake")),
            "special_token_in_content",
        ),
        (
            "{% for m in messages %}{% if m['role'] == 'system' %}{{ raise_exception('no system') }}"
            "{% endif %}{{ m['content'] }}<|im_end|>{% endfor %}",
            conv(("system", "s"), ("user", "q"), ("assistant", "a")),
            "template_error",
        ),
        # Renders the number of messages first: no prefix of the conversation renders as a
        # prefix of the whole, so no span can be proven: skipped, never guessed.
        (
            "{{ messages | length }}" + CHATML,
            conv(("user", "q"), ("assistant", "a")),
            "mask_mismatch",
        ),
    ],
)
def test_template_stage_skips(template: str, c: Conversation, reason: str) -> None:
    (out,) = ChatTemplate.probe(tiny_tokenizer(template)).tokenize([c])
    assert isinstance(out, Skip) and out.reason == reason


# ---- the real SmolLM2 tokenizer (GGUF asset) ----------------------------------------------


@pytest.mark.slow
def test_smollm2_chatml_mask_token_by_token() -> None:
    tok = smollm2_tokenizer()
    chat = ChatTemplate.probe(tok)
    assert chat.end_of_turn_id == 2
    doc = templated(chat, MULTI)
    _check_chatml_boundaries(tok, MULTI, doc)
    (a, b), _ = spans(doc.loss_mask)
    assert doc.input_ids[a - 4 : a].tolist() == [1, 520, 9531, 198]  # <|im_start|>assistant\n
    assert doc.input_ids[b - 1 : b + 1].tolist() == [2, 198]  # <|im_end|> supervised, \n not
    # SmolLM2's template adds its default system prompt when there is none: never supervised.
    bare = conv(("user", "Hello!"), ("assistant", "Hi."))
    doc = templated(chat, bare)
    assert "You are a helpful AI assistant" in tok.decode(doc.input_ids[~doc.loss_mask])
    assert decoded_spans(tok, doc) == ["Hi.<|im_end|>"]


@pytest.mark.slow
def test_smollm2_tokenizer_with_qwen3_style_template() -> None:
    tok = smollm2_tokenizer(QWEN3_STYLE)
    doc = templated(ChatTemplate.probe(tok), THINKING)
    assert decoded_spans(tok, doc) == [
        "Answer one.<|im_end|>",
        "<think>\nsecond reasoning\n</think>\n\nAnswer two.<|im_end|>",
    ]
    doc_off = templated(ChatTemplate.probe(tok, enable_thinking=False), THINKING)
    # Thinking off but the data has reasoning: supervision starts where the render departs
    # from the generation prompt (inside the think block), never inside the header.
    _, (a1, _) = spans(doc_off.loss_mask)
    assert tok.decode(doc_off.input_ids[:a1]).endswith("<|im_start|>assistant\n<think>\n")


@pytest.mark.slow
def test_smollm2_masks_on_real_sharegpt_match_two_oracles() -> None:
    """Real conversations: (1) transformers' {% generation %} mask, (2) token-level prefix diff."""
    tok = smollm2_tokenizer()
    gen_tok = smollm2_tokenizer(CHATML_GENERATION)
    convs = [
        c
        for c in itertools.islice(read_records("asset:sharegpt"), 150)
        if isinstance(c, Conversation)
    ]
    docs = ChatTemplate.probe(tok).tokenize(convs)
    gen_docs = ChatTemplate.probe(gen_tok).tokenize(convs)
    for c, doc, gdoc in zip(convs, docs, gen_docs):
        assert isinstance(doc, TemplatedDoc) and isinstance(gdoc, TemplatedDoc)
        ref = gen_tok.apply_chat_template(
            c.messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
        )
        assert gdoc.input_ids.tolist() == ref["input_ids"]
        assert gdoc.loss_mask.astype(int).tolist() == ref["assistant_masks"], c.id
    for c, doc in list(zip(convs, docs))[:60]:
        assert isinstance(doc, TemplatedDoc)
        full = doc.input_ids.tolist()
        expected = np.zeros(len(full), dtype=bool)
        for i, m in enumerate(c.messages):
            if m["role"] != "assistant":
                continue
            prompt = tok.apply_chat_template(c.messages[:i], add_generation_prompt=True)[
                "input_ids"
            ]
            through = tok.apply_chat_template(c.messages[: i + 1])["input_ids"]
            assert full[: len(prompt)] == prompt and full[: len(through)] == through
            assert through[-2:] == [2, 198]
            expected[len(prompt) : len(through) - 1] = True  # all but the trailing "\n"
        assert (doc.loss_mask == expected).all(), c.id
