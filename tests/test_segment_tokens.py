"""Piece-cached tokenization of growing chat renders (data/segment_tokens.py): equal to a
whole tokenization, and switched off when a tokenizer's pieces do not compose."""

from __future__ import annotations

from typing import Any

from test_data_support import smollm2_tokenizer, tiny_tokenizer

from dflash_trainer.data.segment_tokens import SegmentTokenizer
from dflash_trainer.data.template import ChatTemplate

_TURNS = [
    ("user", "How many legs do 3 spiders have?"),
    ("assistant", "\n\nEach spider has 8 legs, so 3 * 8 = 24 legs."),
    ("user", "  And ants? <think> counts"),
    ("assistant", "Ants have 6 legs each.\n"),
    ("user", "Thanks!"),
]


def _renders(tok: Any) -> list[str]:
    chat = ChatTemplate.probe(tok)
    msgs = [{"role": r, "content": c} for r, c in _TURNS]
    return [chat.render(msgs[:k], add_generation_prompt=True) for k in range(1, len(msgs) + 1, 2)]


def _whole(tok: Any, text: str) -> list[int]:
    return list(tok(text, add_special_tokens=False)["input_ids"])


def test_pieces_equal_whole_tokenization_on_real_and_tiny_tokenizers() -> None:
    for tok in (smollm2_tokenizer(), tiny_tokenizer()):
        seg = SegmentTokenizer(tok, check_first=0, check_every=10**9)  # never compares itself
        for _ in range(2):  # the second pass answers from the cache
            for text in _renders(tok):
                assert seg(text) == _whole(tok, text)
        assert seg.enabled and seg.cache


def test_a_tokenizer_whose_pieces_do_not_compose_is_caught_and_answered_whole() -> None:
    """Metaspace with a prefix space on the first piece only: a later piece tokenized on its
    own gets a prefix it does not get inside the text. The check notices and turns off."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tk = Tokenizer(models.BPE(unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first")
    corpus = [f"{r} {c}" for r, c in _TURNS] * 20
    trainer = trainers.BpeTrainer(
        vocab_size=200, special_tokens=["<unk>", "<|im_start|>", "<|im_end|>"], show_progress=False
    )
    tk.train_from_iterator(corpus, trainer)
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="<|im_end|>")
    text = "<|im_start|>user Hello<|im_end|> there"
    seg = SegmentTokenizer(tok)
    assert seg(text) == _whole(tok, text)  # the answer is right even on the failing call
    assert not seg.enabled and seg.mismatches == 1
    assert seg(text + " again") == _whole(tok, text + " again")
