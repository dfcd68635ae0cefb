"""Evaluation: metrics on hand-built steps, the real prompt sets, evaluate_prompts, reports.

`evaluate_prompts` runs on a tiny llama target with a word-level tokenizer built in code
(a real fast tokenizer with a chat template), so multi-turn handling, the lossless check
and the measured tau are tested in seconds; the real SmolLM2 path is in test_evaluate_cli.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
from test_speculative import VOCAB, OracleDrafter, drafter_spec, make_target, random_dflash
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from dflash_trainer.config import EvalConfig
from dflash_trainer.core.drafter import DFlashDrafter
from dflash_trainer.errors import DFlashError
from dflash_trainer.eval.evaluate import evaluate_prompts
from dflash_trainer.eval.loading import check_compatible, split_target
from dflash_trainer.eval.prompt_run import render_prompt, stop_token_ids
from dflash_trainer.eval.prompts import load_prompt_set
from dflash_trainer.eval.report import (
    acceptance_metrics,
    build_report,
    lossless_check,
    markdown,
    speed_metrics,
    write_all,
)
from dflash_trainer.eval.speculative import Generation
from dflash_trainer.target.model import FrozenTarget

pytestmark = pytest.mark.usefixtures("one_thread")


def gen(tokens, accepted=(), decode_s=1.0, prefill_s=0.5, margins=None) -> Generation:
    return Generation(
        prompt_len=3,
        tokens=list(tokens),
        accepted=list(accepted),
        block_size=4,
        prefill_s=prefill_s,
        decode_s=decode_s,
        stop_reason="max_new_tokens",
        target_forwards=len(accepted),
        margins=margins,
    )


# ----------------------------------------------------------------------------- metrics


def test_acceptance_metrics_on_hand_built_steps():
    m = acceptance_metrics([[3, 3, 0], [1], []], block_size=4)
    assert m["tau"] == pytest.approx((3.0 + 2.0) / 2)  # per response: (4+4+1)/3, 2/1
    assert m["tau_pooled"] == pytest.approx((4 + 4 + 1 + 2) / 4)
    assert m["accepted_histogram"] == [1, 1, 0, 2]
    assert m["num_steps"] == 4
    # slot 1: reached by 4 steps, taken by 3; slot 2: 3 reach, 2 take; slot 3: 2 reach, 2 take.
    assert m["per_position_acceptance"] == pytest.approx([3 / 4, 2 / 3, 1.0])
    assert m["accepted_fraction"] == pytest.approx([0.25, 0.25, 0.0, 0.5])


def test_acceptance_metrics_without_steps_are_nan_not_errors():
    m = acceptance_metrics([[], []], block_size=3)
    assert math.isnan(m["tau"]) and math.isnan(m["tau_pooled"])
    assert m["accepted_histogram"] == [0, 0, 0]
    assert all(math.isnan(r) for r in m["per_position_acceptance"])


def test_speed_metrics_pool_decode_time_and_exclude_prefill():
    m = speed_metrics([gen(range(11), decode_s=2.0), gen(range(5), decode_s=2.0, prefill_s=9)])
    assert m["decode_tokens"] == 10 + 4  # the prefill makes each response's first token
    assert m["decode_tokens_per_s"] == pytest.approx(14 / 4.0)
    assert m["tpot_ms"] == pytest.approx(1000 * 4.0 / 14)
    assert m["mean_tpot_ms"] == pytest.approx(1000 * (0.2 + 0.5) / 2)
    assert m["prefill_s"] == pytest.approx(9.5)


def test_lossless_check_reports_the_first_difference_and_the_margin():
    base = gen([1, 2, 3, 4], margins=[5.0, 4.0, 0.001, 2.0])
    assert lossless_check(gen([1, 2, 3, 4]), base) == {
        "match": True,
        "first_mismatch": None,
        "target_margin": None,
    }
    bad = lossless_check(gen([1, 2, 9, 4]), base)
    assert bad == {"match": False, "first_mismatch": 2, "target_margin": 0.001}
    assert lossless_check(gen([1, 2]), base)["first_mismatch"] == 2  # shorter = different


# ----------------------------------------------------------------------------- prompt sets


def test_real_prompt_sets_have_their_published_sizes():
    gsm = load_prompt_set("gsm8k")
    mt = load_prompt_set("mt-bench")
    he = load_prompt_set("humaneval")
    assert (gsm.total, len(gsm.prompts)) == (1319, 1319)
    assert len(mt.prompts) == 80
    assert all(len(p.messages) == 2 for p in mt.prompts)
    assert all(m["role"] == "user" for p in mt.prompts for m in p.messages)
    assert len(he.prompts) == 164
    assert (
        he.prompts[0].id == "HumanEval/0"
        and "def has_close_elements" in (he.prompts[0].messages[0]["content"])
    )
    assert gsm.prompts[0].messages[0]["content"].startswith("Janet")
    assert "\\boxed{}" in gsm.prompts[0].messages[0]["content"]


def test_max_samples_gives_a_seeded_subset_in_source_order():
    a = load_prompt_set("gsm8k", max_samples=5, seed=1)
    b = load_prompt_set("gsm8k", max_samples=5, seed=1)
    c = load_prompt_set("gsm8k", max_samples=5, seed=2)
    ids = [p.id for p in a.prompts]
    assert ids == [p.id for p in b.prompts] and ids != [p.id for p in c.prompts]
    assert [int(i) for i in ids] == sorted(int(i) for i in ids)
    assert a.total == 1319 and len(a.prompts) == 5


def test_jsonl_prompt_files_in_every_accepted_shape(tmp_path):
    path = tmp_path / "mine.jsonl"
    rows = [
        "just a string",
        {"prompt": "p1", "id": "a"},
        {"turns": ["t1", "t2"]},
        {"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]},
    ]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    ps = load_prompt_set(str(path))
    assert [p.id for p in ps.prompts] == ["1", "a", "3", "4"]
    assert ps.prompts[2].messages == [
        {"role": "user", "content": "t1"},
        {"role": "user", "content": "t2"},
    ]
    assert ps.prompts[3].messages[0]["role"] == "system"


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ('{"answer": 3}', "no prompt found"),
        ('{"turns": []}', "non-empty list"),
        ("{not json", "not valid JSON"),
        ('{"messages": [{"role": "assistant", "content": "x"}]}', "no user message"),
    ],
)
def test_bad_jsonl_prompts_name_the_line_and_the_fix(tmp_path, line, message):
    path = tmp_path / "bad.jsonl"
    path.write_text('"fine"\n' + line + "\n")
    with pytest.raises(DFlashError, match=message) as e:
        load_prompt_set(str(path))
    assert "bad.jsonl:2" in str(e.value)


def test_unknown_prompt_set_is_a_clear_error():
    with pytest.raises(DFlashError, match="not a built-in set"):
        load_prompt_set("gsm9k")


def test_split_target_understands_gguf_specs():
    assert split_target("/m/dir::f.gguf") == ("/m/dir", "f.gguf")
    assert split_target("/m/dir/f.gguf") == ("/m/dir", "f.gguf")
    assert split_target("Qwen/Qwen3-8B") == ("Qwen/Qwen3-8B", None)


# ----------------------------------------------------------------------------- evaluate_prompts


def word_tokenizer() -> PreTrainedTokenizerFast:
    """A word-level fast tokenizer over the tiny target's 101 ids, with a chat template."""
    words = ["[UNK]", "<|end|>", "<|user|>", "<|assistant|>"] + [f"w{i}" for i in range(97)]
    assert len(words) == VOCAB
    tk = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=tk,
        unk_token="[UNK]",
        eos_token="<|end|>",
        additional_special_tokens=["<|user|>", "<|assistant|>"],
    )
    tok.chat_template = (
        "{% for m in messages %}<|{{ m.role }}|> {{ m.content }} <|end|> {% endfor %}"
        "{% if add_generation_prompt %}<|assistant|> {% endif %}"
    )
    return tok


CONVERSATIONS = [
    [{"role": "user", "content": "w5 w9 w13 w2"}],
    [{"role": "user", "content": "w7 w7 w40"}, {"role": "user", "content": "w41 w3"}],
]
GREEDY = EvalConfig(max_new_tokens=13, temperature=0.0)


def test_oracle_and_wrong_drafters_measure_tau_block_size_and_one():
    target, tok = make_target("llama"), word_tokenizer()
    good = evaluate_prompts(
        OracleDrafter(target, 4), target, tok, CONVERSATIONS, GREEDY, stop_ids=[]
    )
    bad = evaluate_prompts(
        OracleDrafter(target, 4, "all"), target, tok, CONVERSATIONS, GREEDY, stop_ids=[]
    )
    assert good["num_responses"] == bad["num_responses"] == 3
    assert good["tau"] == good["tau_pooled"] == 4.0  # 13 tokens = 1 + 3 blocks of 4
    assert good["per_position_acceptance"] == [1.0, 1.0, 1.0]
    assert bad["tau"] == bad["tau_pooled"] == 1.0
    assert bad["accepted_histogram"] == [3 * 12, 0, 0, 0]


def test_multi_turn_feeds_the_generated_answer_back_before_the_next_turn():
    target, tok = make_target("llama"), word_tokenizer()
    res = evaluate_prompts(OracleDrafter(target, 4), target, tok, CONVERSATIONS, GREEDY)
    first, second = res["responses"][1], res["responses"][2]
    assert (first["prompt"], first["turn"], second["prompt"], second["turn"]) == ("1", 0, "1", 1)
    history = [
        CONVERSATIONS[1][0],
        {"role": "assistant", "content": first["text"]},
        CONVERSATIONS[1][1],
    ]
    assert second["prompt_tokens"] == len(render_prompt(tok, history, False))
    assert second["prompt_tokens"] > first["prompt_tokens"] + 3


def test_given_assistant_turns_are_history_not_questions():
    target, tok = make_target("llama"), word_tokenizer()
    conv = [
        {"role": "user", "content": "w1"},
        {"role": "assistant", "content": "w2 w3"},
        {"role": "user", "content": "w4"},
    ]
    res = evaluate_prompts(OracleDrafter(target, 3), target, tok, [conv], GREEDY)
    assert res["num_responses"] == 1
    assert res["responses"][0]["prompt_tokens"] == len(render_prompt(tok, conv, False))


def test_a_training_dflash_drafter_is_evaluated_without_noise_and_left_training():
    target, tok = make_target("llama"), word_tokenizer()
    torch.manual_seed(0)
    model = DFlashDrafter(drafter_spec(4), noise_std=0.5)
    model.reset_parameters(std=0.3)
    model.train()
    seen: list[torch.Tensor] = []
    model.fc.register_forward_hook(lambda _m, inp, _out: seen.append(inp[0].detach()))
    res = evaluate_prompts(model, target, tok, CONVERSATIONS, GREEDY, baseline=True)
    assert model.training
    # The first context the drafter projects is the first prompt's features, noise-free.
    prompt = torch.tensor(render_prompt(tok, CONVERSATIONS[0], False))
    want = target.forward_documents([prompt], need_final=False).features_TF
    torch.testing.assert_close(seen[0], want, atol=1e-5, rtol=1e-5)
    assert res["lossless_mismatches"] == 0 and res["mismatched"] == []
    assert math.isfinite(res["speedup"]) and res["speedup"] > 0
    assert res["baseline"]["decode_tokens"] > 0
    assert res["block_size"] == 4


def test_sampling_eval_is_seeded_and_has_no_lossless_check():
    target, tok = make_target("llama"), word_tokenizer()
    cfg = EvalConfig(max_new_tokens=10, temperature=1.0, top_p=0.9, seed=3)
    runs = [
        evaluate_prompts(OracleDrafter(target, 4), target, tok, CONVERSATIONS, cfg, baseline=True)
        for _ in range(2)
    ]
    assert [r["text"] for r in runs[0]["responses"]] == [r["text"] for r in runs[1]["responses"]]
    assert "lossless_mismatches" not in runs[0] and "speedup" in runs[0]


def test_the_draft_temperature_scale_reaches_the_drafts_and_the_report():
    target, tok = make_target("llama"), word_tokenizer()
    model = random_dflash(target, 4).model
    runs = {}
    for scale in (1.0, 0.3):
        cfg = EvalConfig(max_new_tokens=16, temperature=1.0, seed=3, draft_temperature_scale=scale)
        runs[scale] = evaluate_prompts(model, target, tok, CONVERSATIONS, cfg)
        assert runs[scale]["draft_temperature_scale"] == scale
    # Same seed, drafts at another temperature: other drafts, other acceptance.
    assert runs[1.0]["accepted_histogram"] != runs[0.3]["accepted_histogram"]


def test_stop_ids_come_from_tokenizer_and_generation_config():
    target, tok = make_target("llama"), word_tokenizer()
    target.model.generation_config.eos_token_id = [7, 1]
    assert stop_token_ids(tok, target.model) == [1, 7]


def test_a_drafter_for_another_target_is_refused():
    target = FrozenTarget(make_target("llama").model, [0, 3])  # drafter taps [0, 2]
    with pytest.raises(DFlashError, match=r"tapped layers: target \[0, 3\], drafter \[0, 2\]"):
        check_compatible(drafter_spec(4), target)


# ----------------------------------------------------------------------------- reports


def test_report_files_are_written_and_json_has_no_nan(tmp_path):
    target, tok = make_target("llama"), word_tokenizer()
    res = evaluate_prompts(OracleDrafter(target, 4), target, tok, CONVERSATIONS, GREEDY, True)
    res["num_prompts"] = 2
    empty = evaluate_prompts(OracleDrafter(target, 4), target, tok, [], GREEDY)
    identity = {"drafter": {"path": "d"}, "target": {"name_or_path": "tiny"}}
    report = build_report({"tiny": res, "empty": empty}, GREEDY, identity, {"_run": print})
    paths = write_all(report, tmp_path / "out")
    assert [p.name for p in paths] == [
        "eval.json",
        "eval.md",
        "acceptance_histogram.png",
        "tau_per_set.png",
    ]
    loaded = json.loads(paths[0].read_text())  # strict JSON: NaN became null
    assert loaded["sets"]["empty"]["tau"] is None
    assert loaded["sets"]["tiny"]["tau"] == 4.0
    assert loaded["config"]["max_new_tokens"] == 13
    for png in paths[2:]:
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    md = markdown(loaded)
    assert "| tiny | 2 | 3 | 4.00 | 4.00 |" in md
    assert "| ok |" in md and "- tiny: 1.00 1.00 1.00" in md
