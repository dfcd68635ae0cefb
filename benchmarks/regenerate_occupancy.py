"""Row occupancy of the static engine: all-turn regeneration against first turns only, on CPU.

What it measures: where turn-by-turn regeneration loses decode steps against answering first
turns only, in counts that do not depend on the device (the engine's EngineStats and a per-step
trace): the share of row-steps that held a live answer, decode steps per generated token,
shape builds, prefills, the decode steps with fewer than half the rows busy and why, and the
K/V slots a dense decode attention reads per generated token.

The workload follows the ShareGPT asset: `--conversations` sampled at random (seeded); each
turn's prompt length is that of the real conversation rendered by the SmolLM2 chat template
(system prompt, user turns, and as the history the asset's answers cut at max_new_tokens),
and each answer's length is the asset answer's (plus its end-of-turn token, cut at
max_new_tokens). A conversation ends where `dflash data regenerate` would end it at
`--max-conversation-tokens`. Lengths are scaled by `--scale` (default 1/4: 512 new tokens
become 128, the 4,096-token conversation budget 1,024), which keeps the engine's cache
buckets in the same relation to the work (powers of two, at least 256: 1,024..8,192 become
256..2,048); the engine runs with its own rules, the GPU's refill grouping (an eighth of the
rows) and `--rows` rows.

The model is a real HF Llama (2 layers, random weights) whose embedding and output head are
planted so that greedy decoding walks a fixed chain of token ids that ends at the stop id:
the last token of a prompt decides how many tokens its answer has, so every answer is exactly
as long as the workload says (checked for every turn). Prompts are filler ids around that.

    python benchmarks/regenerate_occupancy.py --out carry.json        # the engine as it is
    python benchmarks/regenerate_occupancy.py --no-carry-rows --out drain.json
    python benchmarks/regenerate_occupancy.py --answers-at-limit 0.596 ...  # SmolLM2-like answers
    python benchmarks/regenerate_occupancy.py --resume-after 2 --conversations 1024 ...

The runs of regenerate_occupancy_cpu_202612.md: bash benchmarks/regenerate_occupancy_runs.sh.

Runtime on one CPU thread: about 30 s at the defaults (15 s of it reading the asset and\nits tokenizer); `--rows 256 --conversations 2048` about 80 s.
"""

from __future__ import annotations

import argparse
import bisect
import itertools
import json
import math
import os
import random
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from dflash_trainer.data.engine import StaticBatchEngine
from dflash_trainer.data.engine_state import cache_length
from dflash_trainer.data.settings import GenerationSettings

STOP, PAD, FIRST_CHAIN = 2, 0, 3
"""Token ids: the stop id, the pad id, the first id of the planted chain."""
HIDDEN = 32


@dataclass
class Turn:
    new: int
    """Prompt tokens this turn adds after the history (the whole prompt for the first)."""
    answer: int
    """Tokens the target generates (the end-of-turn id included when it stops by itself)."""
    kept: bool = True
    """False for a turn generated, then dropped: it took the conversation over the budget."""


def real_turns(chat: Any, messages: list[dict[str, str]], max_new: int) -> list[tuple[int, int]]:
    """(prompt tokens, answer tokens) per user turn, in real tokens: the conversation rendered
    with each answer cut at max_new tokens, every prompt counted on that one tokenization (a
    turn's prompt is a prefix of the whole render in a template like ChatML)."""
    tok = chat.tokenizer
    msgs = [m for m in messages[:1] if m["role"] == "system"]
    prompts, answers = [], []
    for i, m in enumerate(messages):
        if m["role"] != "user":
            continue
        nxt = messages[i + 1] if i + 1 < len(messages) else None
        answer = nxt["content"] if nxt is not None and nxt["role"] == "assistant" else ""
        msgs.append({"role": "user", "content": m["content"]})
        prompts.append(chat.render(msgs, add_generation_prompt=True))
        ids = tok(answer, add_special_tokens=False)["input_ids"]
        msgs.append({"role": "assistant", "content": tok.decode(ids[: max_new - 1])})
        answers.append(min(len(ids) + 1, max_new))  # + the end-of-turn id
    text = chat.render(msgs)
    ends = [
        e
        for _s, e in tok(text, add_special_tokens=False, return_offsets_mapping=True)[
            "offset_mapping"
        ]
    ]
    if not all(text.startswith(p) for p in prompts):
        raise SystemExit("the chat template does not render a turn's prompt as a prefix")
    return [(bisect.bisect_right(ends, len(p)), a) for p, a in zip(prompts, answers)]


def workload(args: argparse.Namespace) -> list[list[Turn]]:
    """The sampled conversations as scaled turns, cut where regeneration would cut them."""
    from dflash_trainer.data.formats import read_records
    from dflash_trainer.data.loading import load_tokenizer
    from dflash_trainer.data.records import Conversation
    from dflash_trainer.data.template import ChatTemplate

    convs = [
        c
        for c in read_records(args.input, require_assistant=False)
        if isinstance(c, Conversation) and any(m["role"] == "user" for m in c.messages)
    ]
    convs = random.Random(args.seed).sample(convs, min(args.conversations, len(convs)))
    chat = ChatTemplate.probe(load_tokenizer(args.tokenizer))
    s, real_new = args.scale, round(args.max_new_tokens / args.scale)
    budget = args.max_conversation_tokens
    out = []
    for n, c in enumerate(convs):
        turns: list[Turn] = []
        prompt, before = 0, 0
        for t, (p, a) in enumerate(real_turns(chat, c.messages, real_new)):
            limit = args.answers_at_limit
            if limit is not None and random.Random(f"{args.seed}/{n}/{t}").random() < limit:
                a = real_new  # the target's own answers run to the limit this often
            new = max(1, round((p - before) * s))
            answer = (
                args.max_new_tokens
                if a >= real_new
                else min(args.max_new_tokens, max(1, round(a * s)))
            )
            if prompt + new >= budget:  # no room left for an answer: the conversation ends
                break
            prompt += new
            turns.append(Turn(new, answer))
            if prompt + answer + 1 > budget:  # answered, then dropped (regenerate does so)
                turns[-1].kept = False
                break
            prompt += answer
            before = p + a
        k = args.resume_after
        if k and len(turns) > k:  # a resumed job: the first k turns are history, not asked
            history = sum(t.new + t.answer for t in turns[:k])
            turns = [Turn(history + turns[k].new, turns[k].answer, turns[k].kept), *turns[k + 1 :]]
        elif k:
            turns = []
        if turns:
            out.append(turns)
    return out


class GpuRowsEngine(StaticBatchEngine):
    """The engine with its GPU rule for rows, which the CPU path does not apply: a cache
    length gets the rows whose caches fit `kv_fraction` of the free memory, here
    `kv_positions` positions (that fraction of the memory free without caches) less that
    fraction of the positions the shapes it keeps built hold."""

    kv_positions = 0

    def _rows_for(self, length: int, wanted: int) -> int:
        rows = super()._rows_for(length, wanted)
        if not self.kv_positions:
            return rows
        held = sum(s.rows * s.length for s in self._built.values())
        return max(1, min(rows, int(self.kv_positions - self.kv_fraction * held) // length))


def planted_model(max_new: int, vocab: int) -> Any:
    """A 2-layer Llama with random layers whose embedding and head make greedy decoding walk
    chain id FIRST_CHAIN + j -> FIRST_CHAIN + j + 1, and the chain's last id -> STOP."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=vocab,
        hidden_size=HIDDEN,
        intermediate_size=2 * HIDDEN,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=8192,
        eos_token_id=STOP,
        pad_token_id=PAD,
        tie_word_embeddings=False,
        attn_implementation="sdpa",
    )
    model = LlamaForCausalLM(cfg).eval()
    chain = [*range(FIRST_CHAIN, FIRST_CHAIN + max_new + 1), STOP]
    with torch.no_grad():
        emb = torch.randn(vocab, HIDDEN)
        model.model.embed_tokens.weight.copy_(emb)
        head = torch.zeros(vocab, HIDDEN)
        for a, b in itertools.pairwise(chain):  # b's logit is large where the input token is a
            head[b] = 10 * emb[a] / emb[a].norm()
        model.lm_head.weight.copy_(head)
    return model


def control_id(answer: int, max_new: int) -> int:
    """The last prompt id whose greedy walk stops after `answer` tokens (never, within
    max_new, for an answer of max_new tokens: it ends at the limit)."""
    chain_len = max_new + 1  # ids FIRST_CHAIN .. FIRST_CHAIN + max_new, then STOP
    return FIRST_CHAIN + (0 if answer >= max_new else chain_len - answer)


def leg(
    model: Any, convs: list[list[Turn]], args: argparse.Namespace, all_turns: bool
) -> dict[str, Any]:
    max_new, vocab = args.max_new_tokens, model.config.vocab_size
    fillers = range(FIRST_CHAIN + max_new + 1, vocab)

    def prompt_part(chain: int, t: int) -> list[int]:
        turn, rng = plan[chain][t], random.Random(f"{args.seed}/{chain}/{t}")
        return [rng.choice(fillers) for _ in range(turn.new - 1)] + [
            control_id(turn.answer, max_new)
        ]

    plan = [c if all_turns else c[:1] for c in convs]
    current = [prompt_part(c, 0) for c in range(len(plan))]
    ends: list[list[int]] = [[] for _ in plan]  # trace clock at each answer
    mismatched, context, prompt_tokens = 0, 0, sum(map(len, current))
    engine = GpuRowsEngine(
        model,
        GenerationSettings("occupancy", max_new_tokens=max_new),
        [STOP],
        PAD,
        rows=args.rows,
        refill_rows=max(1, args.rows // 8),
        prefill_tokens=args.prefill_tokens,
        reuse_prefix=True,
        carry_rows=not args.no_carry_rows,
    )
    engine.kv_positions = args.kv_positions_per_row * args.rows
    engine.trace = []

    def follow(chain: int, ids: list[int]) -> tuple[list[int], int] | None:
        nonlocal mismatched, context, prompt_tokens
        t = len(ends[chain])
        turn = plan[chain][t]
        mismatched += len(ids) != turn.answer
        context += len(ids) * len(current[chain]) + len(ids) * (len(ids) - 1) // 2
        ends[chain].append(len(engine.trace or ()))
        if t + 1 == len(plan[chain]):
            return None
        current[chain] = current[chain] + ids + prompt_part(chain, t + 1)
        prompt_tokens += len(current[chain])
        return current[chain], 0

    t0 = time.perf_counter()
    engine.generate_chains([(p, 0) for p in current], follow)
    seconds = time.perf_counter() - t0
    generated = sum(t.answer for c in plan for t in c)
    fed = prompt_tokens - engine.stats.reused_tokens
    return summarize(engine, plan, ends, generated, context, fed, mismatched, seconds)


def why_idle(
    trace: list[tuple[int, int, int, int, int]], ends: list[list[int]]
) -> tuple[dict[str, int], dict[str, int]]:
    """Idle row-steps by reason, and decode steps with fewer than half the rows busy by the
    first reason that would have lifted them to half. Idle rows are put down, in turn, to:

    refill_grouping: prompts of this cache length wait for a refill group (an eighth of the
        rows on a GPU: a prefill costs about as much as many decode steps);
    longer_bucket: prompts wait for a longer cache length until this one drains;
    next_turns_wait: nothing else waits, and conversations decoding now have later turns,
        each waiting for its current answer (a chain's turns run one after another);
    last_answers: nothing waits, and every conversation decoding is on its last turn."""
    penultimate = sorted(e[-2] for e in ends if len(e) >= 2)
    low: dict[str, int] = {}
    idle: dict[str, int] = {}
    for clock, (_length, rows, busy, queued, waiting) in enumerate(trace):
        free = rows - busy
        grouped, longer = min(free, queued), min(free - min(free, queued), waiting)
        chained = len(penultimate) - bisect.bisect_right(penultimate, clock) > 0
        tail = "next_turns_wait" if chained else "last_answers"
        for why, n in (
            ("refill_grouping", grouped),
            ("longer_bucket", longer),
            (tail, free - grouped - longer),
        ):
            idle[why] = idle.get(why, 0) + n
        if 2 * busy < rows:
            why = tail
            if 2 * (busy + grouped) >= rows:
                why = "refill_grouping"
            elif 2 * (busy + grouped + longer) >= rows:
                why = "longer_bucket"
            low[why] = low.get(why, 0) + 1
    return low, idle


def summarize(
    engine: StaticBatchEngine,
    plan: list[list[Turn]],
    ends: list[list[int]],
    generated: int,
    context: int,
    fed: int,
    mismatched: int,
    seconds: float,
) -> dict[str, Any]:
    st, trace = engine.stats, engine.trace or []
    low, idle = why_idle(trace, ends)
    dense = sum(rows * length for length, rows, _b, _q, _w in trace)
    by_length: dict[int, list[int]] = {}
    for length, rows, busy, _q, _w in trace:
        b = by_length.setdefault(length, [0, 0, 0])
        b[0], b[1], b[2] = b[0] + 1, b[1] + rows, b[2] + busy
    tenth = max(1, math.ceil(len(trace) / 10))
    timeline = [
        round(sum(t[2] for t in trace[i : i + tenth]) / sum(t[1] for t in trace[i : i + tenth]), 3)
        for i in range(0, len(trace), tenth)
    ]
    stats = {k: v for k, v in asdict(st).items() if not k.endswith("_s")}
    return {
        "conversations": len(plan),
        "turns": sum(len(c) for c in plan),
        "turns_kept": sum(t.kept for c in plan for t in c),
        "generated_tokens": generated,
        "answers_of_wrong_length": mismatched,
        "occupancy": round(st.row_steps_busy / max(1, st.row_steps), 4),
        "decode_steps_per_token": round(st.decode_steps / max(1, generated), 5),
        "ideal_decode_steps_per_token": round(1 / engine.max_rows, 5),
        "steps_under_half_busy": sum(low.values()),
        "steps_under_half_busy_by_reason": low,
        "idle_row_steps_by_reason": idle,
        "by_cache_length": {
            str(k): {
                "decode_steps": v[0],
                "tokens": v[2],
                "occupancy": round(v[2] / v[1], 4),
                "share_of_dense_kv_slots": round(k * v[1] / max(1, dense), 3),
            }
            for k, v in sorted(by_length.items())
        },
        "occupancy_by_tenth_of_steps": timeline,
        "dense_kv_slots_per_token": round(dense / max(1, generated), 1),
        "context_per_token": round(context / max(1, generated), 1),
        "prefilled_per_token": round(fed / max(1, generated), 3),
        "engine": stats,
        "seconds": round(seconds, 2),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--input", default="asset:sharegpt")
    p.add_argument("--tokenizer", default="asset:smollm2-135m-instruct")
    p.add_argument("--conversations", type=int, default=512)
    p.add_argument("--rows", type=int, default=64, help="the engine's rows (B)")
    p.add_argument("--scale", type=float, default=0.25, help="lengths x this (real: 1)")
    p.add_argument("--max-new-tokens", type=int, default=128, help="scaled (real 512 x scale)")
    p.add_argument("--max-conversation-tokens", type=int, default=1024, help="scaled")
    p.add_argument("--prefill-tokens", type=int, default=8192, help="scaled (GPU 32768)")
    p.add_argument(
        "--kv-positions-per-row",
        type=int,
        default=715,
        help="memory for the caches, in positions per row (scaled): 715 = the H200 with "
        "SmolLM2-135M (half of ~135 GB free over 23,040 bytes a position, at 1,024 rows, "
        "x 1/4); 0: no cap",
    )
    p.add_argument(
        "--answers-at-limit",
        type=float,
        default=None,
        help="share of answers that run to max_new_tokens (SmolLM2 on ShareGPT: 0.596); "
        "default: the asset's own answer lengths",
    )
    p.add_argument(
        "--resume-after",
        type=int,
        default=0,
        help="as a resumed job: conversations continue after their first N turns (answered "
        "earlier, prefilled as history); those with no later turn are left out",
    )
    p.add_argument(
        "--no-carry-rows", action="store_true", help="the engine drains each cache length"
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1, help="1: steadiest on a shared CPU")
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    convs = workload(args)
    workload_s = time.perf_counter() - t0
    model = planted_model(args.max_new_tokens, vocab=512)
    with torch.inference_mode():
        legs = {
            name: leg(model, convs, args, all_turns)
            for name, all_turns in (("first_turns", False), ("all_turns", True))
        }
    for name, r in legs.items():
        if r["answers_of_wrong_length"]:
            print(
                f"{name}: {r['answers_of_wrong_length']} answers off the planted length",
                file=sys.stderr,
            )
            return 1
    turns = [len(c) for c in convs]
    first_buckets: dict[str, int] = {}
    for c in convs:
        key = str(cache_length(c[0].new + args.max_new_tokens))
        first_buckets[key] = first_buckets.get(key, 0) + 1
    result = {
        "what": "static engine row occupancy, first turns only vs every turn (CPU, counts)",
        "commit": _commit(),
        "workload": {
            "input": args.input,
            "conversations": len(convs),
            "turns_mean": round(sum(turns) / len(turns), 2),
            "turns_max": max(turns),
            "first_prompt_cache_lengths": first_buckets,
            "answers_at_max_new_tokens": round(
                sum(t.answer >= args.max_new_tokens for c in convs for t in c) / sum(turns), 3
            ),
            "answers_at_limit_forced": args.answers_at_limit,
            "resume_after": args.resume_after,
            "scale": args.scale,
            "max_new_tokens": args.max_new_tokens,
            "max_conversation_tokens": args.max_conversation_tokens,
            "seed": args.seed,
            "seconds": round(workload_s, 1),
        },
        "rows": args.rows,
        "refill_rows": max(1, args.rows // 8),
        "kv_positions": args.kv_positions_per_row * args.rows,
        "carry_rows": not args.no_carry_rows,
        "legs": legs,
        "torch": torch.__version__,
        "hardware": f"cpu, {args.threads} threads",
    }
    _write(args.out, result)
    for name, r in legs.items():
        print(
            f"{name:12} occupancy {r['occupancy']:.1%}  steps/token {r['decode_steps_per_token']:.4f} "
            f"(ideal {r['ideal_decode_steps_per_token']})  builds {r['engine']['builds']}  "
            f"prefills {r['engine']['prefills']}  steps <1/2 busy {r['steps_under_half_busy']} "
            f"{r['steps_under_half_busy_by_reason']}  {r['seconds']} s"
        )
    return 0


def _commit() -> str:
    try:
        return subprocess.run(
            ["git", "describe", "--always", "--dirty"],
            capture_output=True,
            text=True,
            cwd=Path(__file__).parent,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def _write(path: Path, result: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(result, indent=1) + "\n")
    os.replace(tmp, path)


if __name__ == "__main__":
    raise SystemExit(main())
