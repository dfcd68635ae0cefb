"""Shared helpers of the data tests (no tests here): tokenizers, templates, tiny models.

Imported by the test_data_* modules; the caches make each expensive object load once per
pytest session.
"""

from __future__ import annotations

import copy
import functools
import json
from pathlib import Path
from typing import Any

CHATML = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

# Written for these tests, with the behaviour of Qwen3's template: reasoning is split off the
# content at </think>; only assistant turns after the last user turn keep a <think> block
# (earlier ones are rendered without it); the generation prompt gets an empty think block
# when enable_thinking is false.
QWEN3_STYLE = """
{%- set last = namespace(user=-1) -%}
{%- for m in messages -%}{%- if m.role == 'user' -%}{%- set last.user = loop.index0 -%}{%- endif -%}{%- endfor -%}
{%- for m in messages -%}
  {%- if m.role == 'assistant' -%}
    {%- set answer = m.content -%}
    {%- set thought = '' -%}
    {%- if '</think>' in m.content -%}
      {%- set thought = m.content.split('</think>')[0].split('<think>')[-1].strip('\\n') -%}
      {%- set answer = m.content.split('</think>')[-1].lstrip('\\n') -%}
    {%- endif -%}
    {%- if loop.index0 > last.user -%}
      {{- '<|im_start|>assistant\\n<think>\\n' + thought + '\\n</think>\\n\\n' + answer + '<|im_end|>\\n' -}}
    {%- else -%}
      {{- '<|im_start|>assistant\\n' + answer + '<|im_end|>\\n' -}}
    {%- endif -%}
  {%- else -%}
    {{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' -}}
  {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
  {{- '<|im_start|>assistant\\n' -}}
  {%- if enable_thinking is defined and not enable_thinking -%}{{- '<think>\\n\\n</think>\\n\\n' -}}{%- endif -%}
{%- endif -%}
"""

# ChatML with {% generation %} marks: transformers then returns its own assistant mask, an
# oracle independent of our span search.
CHATML_GENERATION = (
    "{% for m in messages %}{% if m['role'] == 'assistant' %}"
    "{{ '<|im_start|>assistant\\n' }}{% generation %}{{ m['content'] + '<|im_end|>' }}"
    "{% endgeneration %}{{ '\\n' }}"
    "{% else %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

# No control token closes a turn: the turn runs to the next message.
PLAIN = (
    "{% for m in messages %}{{ m['role'] | upper + ': ' + m['content'] + '\\n\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ 'ASSISTANT: ' }}{% endif %}"
)

_CORPUS = [
    "Hello! How can I help you today? I am a helpful assistant.",
    "The quick brown fox jumps over the lazy dog. 0123456789",
    "def add(a, b):\n    return a + b\n\n# numbers: 1, 2, 3\n",
    "user assistant system think answer question reasoning step",
    "Bonjour, ça va ? Très bien, merci. Ünïcödé ✓ — “quotes”",
]


@functools.cache
def _tiny_tokenizer() -> Any:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tk.train_from_iterator(_CORPUS * 20, trainer)
    tok = PreTrainedTokenizerFast(
        tokenizer_object=tk, eos_token="<|im_end|>", pad_token="<|endoftext|>"
    )
    # As in Qwen3: <think> and </think> are added tokens that are NOT special.
    tok.add_tokens(["<think>", "</think>"])
    tok.chat_template = CHATML
    return tok


def tiny_tokenizer(chat_template: str = CHATML) -> Any:
    """A byte-level BPE tokenizer built in code (vocab ~400), ChatML specials, <think> tokens."""
    tok = copy.deepcopy(_tiny_tokenizer())
    tok.chat_template = chat_template
    return tok


@functools.cache
def _smollm2() -> Any:
    from dflash_trainer.data.loading import load_tokenizer

    return load_tokenizer("asset:smollm2-135m-instruct")


def smollm2_tokenizer(chat_template: str | None = None) -> Any:
    """The real SmolLM2-135M-Instruct tokenizer (GGUF asset); a copy if the template changes."""
    tok = _smollm2()
    if chat_template is None:
        return tok
    tok = copy.deepcopy(tok)
    tok.chat_template = chat_template
    return tok


def tiny_llama(vocab_size: int, seed: int = 0, eos_token_id: int = 2) -> Any:
    """A random-weight LlamaForCausalLM, fp32, small enough for CPU tests."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        eos_token_id=eos_token_id,
        pad_token_id=0,
        bos_token_id=None,
        tie_word_embeddings=True,
    )
    return LlamaForCausalLM(cfg).eval()


def write_jsonl(path: Path, rows: list[Any]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def sharegpt(*turns: tuple[str, str], rid: str | None = None) -> dict[str, Any]:
    rec: dict[str, Any] = {"conversations": [{"from": f, "value": v} for f, v in turns]}
    if rid is not None:
        rec["id"] = rid
    return rec
