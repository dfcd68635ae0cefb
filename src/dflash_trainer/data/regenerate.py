"""Replace every assistant turn by the target's own answer, turn by turn, resumably.

Why: a drafter learns to predict the target; answers written by another model (ShareGPT's
ChatGPT) teach it someone else's distribution. Turn t is answered with the REGENERATED history
(the target's own answers to turns < t), so the whole conversation is on-policy; the user turns
are kept as they are.

Throughput: the pending prompts of a round are sorted by length and generated in left-padded
batches (little padding per batch; left padding so that every row's next token sits in the last
column). Conversations are processed in windows of `window` conversations: round r generates
turn r of every unfinished conversation of the window. Per-prompt HF `generate` is available as
`per_prompt_generate` (hf_generate.py), the baseline the benchmark compares against. The
static engine (engine.py: fixed-size caches, continuous batching, CUDA graphs) is the default
on a GPU for the targets it supports; it runs each conversation as a chain of turns and takes
the whole job as one window; an OpenAI-compatible server (vLLM, SGLang, ...) is the
`openai` backend (openai_backend.py), run as chains too, concurrent requests in flight.

Length: with `max_conversation_tokens`, a conversation whose render would grow past the budget
ends at the last turn that fits (the turn that overflowed is dropped; a conversation whose
first turn does not fit is skipped), so prepare keeps one document per conversation with
every assistant turn in it.

Output: JSON Lines in the OpenAI messages format, one record per conversation:
    {"id", "messages": [...], "generation": {model, backend, temperature, top_p, max_new_tokens,
     enable_thinking, seed, stop_loops, finish_reasons: ["stop"|"length"|"loop", ...],
     completion_tokens: [...], open: true when user turns were left unanswered at an interrupt}}
Each record is written with one write, flushed and fsynced. Resume: a restarted job reads the
output, drops a partially written last line (a crash mid-write), refuses settings that differ
from those recorded (a file must not mix two distributions), and skips the ids already done.
Sampling is seeded once per job (HF) or per call and prompt index (static engine), so a
resumed job is valid but not bit-identical to an uninterrupted one.

Loops (`stop_loops`): a small target's greedy answer often falls into a cycle and repeats it
to `max_new_tokens`; with loop tails masked at preparation (loop_tails.py) those tokens teach
nothing, and on SmolLM2 the stop saves 37.7% of all completion tokens. The loop stop ends such
an answer once it holds a loop tail (finish reason "loop"), checked every STOP_EVERY tokens so
that every backend cuts at the same length; the cycle's first pass and the first MIN_LOOP
tokens of the loop stay in the answer.

Time limit and interrupt: at `time_limit` (checked at every answer) or on Ctrl-C, every
conversation still open is written with the turns it has answered (`cut_at_interrupt`,
`open` true in its record); a rerun continues it from those turns and replaces its record
(regen_output.py). Greedy answers are those of an uninterrupted job; so are sampled ones on
the static engine, whose sampling keys are per conversation and turn.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol

from dflash_trainer.data.backends import make_generator
from dflash_trainer.data.loop_tails import loop_stop
from dflash_trainer.data.records import Conversation
from dflash_trainer.data.regen_output import (
    Writer,
    compact,
    plan_resume,
    read_output,
)
from dflash_trainer.data.segment_tokens import SegmentTokenizer
from dflash_trainer.data.settings import GenerationSettings
from dflash_trainer.data.template import ChatTemplate
from dflash_trainer.errors import DFlashError
from dflash_trainer.outputs import locks_output


class Generator(Protocol):
    max_batch: int | None
    """Prompts per call; None: give it the whole round (the engine schedules by itself)."""

    def generate(self, prompts: list[list[int]]) -> Sequence[list[int] | None]:
        """New token ids per prompt (may run past the first stop id; the caller cuts);
        None: the prompt was not answered (a server's failure, counted by the backend)."""
        ...


def stop_ids(tokenizer: Any, chat: ChatTemplate, model: Any = None) -> list[int]:
    """Every id that ends a turn: the template's end-of-turn token and the declared EOS ids."""
    ids = {chat.end_of_turn_id, tokenizer.eos_token_id}
    declared = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    ids.update(declared if isinstance(declared, list) else [declared])
    return sorted(i for i in ids if i is not None)


def cut_at_stop(
    new_ids: list[int], stops: Sequence[int], stop_loops: bool = False
) -> tuple[list[int], str, int]:
    """(content ids, finish reason, tokens generated including the stop token).

    With `stop_loops` an answer that loops is cut where the loop stop would have ended it
    (finish reason "loop"): the same place whether the backend stopped it there (the engine)
    or generated on (HF, vLLM).
    """
    stop_set = set(stops)
    end = next((i for i, t in enumerate(new_ids) if t in stop_set), None)
    content = new_ids if end is None else new_ids[:end]
    if stop_loops:
        cut = loop_stop(content)
        if cut is not None:
            return content[:cut], "loop", cut
    if end is None:
        return new_ids, "length", len(new_ids)
    return content, "stop", end + 1


@dataclass
class _State:
    conv: Conversation
    users: list[str]
    messages: list[dict[str, str]]
    finish_reasons: list[str] = field(default_factory=list)
    completion_tokens: list[int] = field(default_factory=list)
    prompt: list[int] | None = None
    written: bool = False
    resumed_turns: int | None = None
    """Turns answered by an earlier job (a continued conversation), else None."""


@dataclass
class RegenerateReport:
    written: int = 0
    already_done: int = 0
    skipped_prompt_too_long: int = 0
    truncated_at_prompt_limit: int = 0
    cut_at_conversation_limit: int = 0
    """Conversations ended at a turn boundary by max_conversation_tokens."""
    skipped_conversation_too_long: int = 0
    """Conversations whose first turn alone exceeds max_conversation_tokens."""
    cut_at_interrupt: int = 0
    """Conversations still open when the job was interrupted or reached its time limit,
    written with the turns they had."""
    continued: int = 0
    """Conversations an earlier job left open, continued from their answered turns."""
    time_limit_reached: bool = False
    oom_splits: int = 0
    new_tokens: int = 0
    seconds: float = 0.0
    finish_reasons: dict[str, int] = field(default_factory=dict)
    engine: dict[str, Any] | None = None
    """The static engine's statistics (data/engine_state.EngineStats), when it ran."""
    not_answered: int = 0
    """Conversations a server failed to answer (written open with the turns they have, or
    not at all): a rerun asks again."""
    server: dict[str, Any] | None = None
    """A server's statistics (data/openai_client.ServerStats), with --backend openai."""

    @property
    def tokens_per_second(self) -> float:
        return self.new_tokens / self.seconds if self.seconds else 0.0


class _TimeUp(Exception):
    """The job's time limit passed: stop at this answer, keep what is answered."""


@locks_output("out_path", "dflash data regenerate", "the regeneration output")
def regenerate(
    conversations: Iterable[Conversation],
    model: Any,
    tokenizer: Any,
    out_path: str | Path,
    temperature: float = 0.0,
    top_p: float = 1.0,
    max_new_tokens: int = 512,
    enable_thinking: bool | None = None,
    batch_size: int = 32,
    max_prompt_tokens: int | None = None,
    max_turns: int | None = None,
    max_conversation_tokens: int | None = None,
    model_name: str | None = None,
    backend: str = "hf",
    seed: int = 0,
    window: int | None = None,
    progress: bool = True,
    engine: dict[str, Any] | None = None,
    time_limit: float | None = None,
    stop_loops: bool = False,
    server: Any = None,
) -> RegenerateReport:
    """Regenerate the assistant turns of `conversations` with `model`, appending to `out_path`.

    `model` is an HF causal LM (backends "hf" and "static"); backend "openai" asks
    `server` (openai_backend.ServerOptions) instead and takes no model.
    A conversation's user turns are answered in order (system turn kept, source answers
    discarded); with `max_turns` only the first turns are. A prompt over `max_prompt_tokens`
    ends the conversation there (its first prompt: the record is skipped); so does a turn
    that takes the rendered conversation over `max_conversation_tokens` (module docstring).
    `stop_loops` ends an answer that loops (data/loop_tails.loop_stop).
    """
    import torch

    out = Path(out_path)
    name = model_name or str(getattr(getattr(model, "config", None), "name_or_path", "") or "")
    settings = GenerationSettings(
        name, temperature, top_p, max_new_tokens, enable_thinking, backend, seed, stop_loops
    )
    kwargs = {} if enable_thinking is None else {"enable_thinking": enable_thinking}
    chat = ChatTemplate.probe(tokenizer, **kwargs)
    stops = stop_ids(tokenizer, chat, model if backend in ("hf", "static") else None)
    if not stops:
        raise DFlashError(
            "the tokenizer declares no end-of-turn or EOS token: generation could not stop"
        )
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else stops[0]
    generator = make_generator(
        model, settings, stops, pad_id, batch_size, engine, server, tokenizer
    )
    report = RegenerateReport()
    index = read_output(out, settings)
    if index.duplicates:  # a job that continued conversations stopped before compacting
        compact(out)
        index = read_output(out, settings)  # the offsets moved
    pending, resume, report.already_done, report.continued = plan_resume(
        conversations, index, max_turns
    )
    torch.manual_seed(seed)
    writer, bar = Writer(out, settings), _progress(len(pending), progress)
    job = _Job(chat, generator, stops, max_prompt_tokens, max_turns, writer, report, bar, 0.0)
    job.resume = resume
    job.max_conversation_tokens = max_conversation_tokens
    job.seed, job.stop_loops = seed, stop_loops
    job.t0 = job.last_line = time.perf_counter()
    job.deadline = job.t0 + time_limit if time_limit is not None else None
    # An engine that runs conversations as chains takes the whole job as one window: every
    # window ends with a tail where the longest conversations finish turn after turn on a
    # nearly idle batch. Rounds (the other backends) keep windows of batch_size x 8.
    chained = hasattr(generator, "generate_chains")
    job.run(pending, window or (max(1, len(pending)) if chained else batch_size * 8))
    report.seconds = time.perf_counter() - job.t0
    report.oom_splits = getattr(generator, "oom_splits", 0)
    stats = getattr(generator, "stats", None)
    report.engine = asdict(stats) if stats is not None else None
    served = getattr(generator, "server_stats", None)
    report.server = asdict(served) if served is not None else None
    return report


def _progress(total: int, enabled: bool) -> Any:
    from tqdm import tqdm

    return tqdm(total=total, unit="conv", disable=not enabled, smoothing=0.1)


@dataclass
class _Job:
    chat: ChatTemplate
    generator: Generator
    stops: list[int]
    max_prompt_tokens: int | None
    max_turns: int | None
    writer: Writer
    report: RegenerateReport
    bar: Any
    t0: float
    max_conversation_tokens: int | None = None
    seed: int = 0
    stop_loops: bool = False
    tokens: SegmentTokenizer | None = None
    """Piece-cached tokenization of the growing renders (data/segment_tokens.py)."""
    deadline: float | None = None
    """perf_counter() past which the job stops at the next answer (`time_limit`)."""
    open_states: list[_State] = field(default_factory=list)
    """The conversations of the running window (kept on an interrupt)."""
    last_line: float = 0.0
    resume: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Id -> the earlier record of a conversation this job continues."""
    rewrote: int = 0
    """Continued conversations written again (their earlier records are compacted away)."""

    def run(self, pending: list[Conversation], step: int) -> None:
        """Every window in turn; at the time limit or on Ctrl-C the open conversations are
        kept (`keep_open`); the output is closed either way."""
        chains = getattr(self.generator, "generate_chains", None)
        try:
            for w in range(0, len(pending), step):
                if chains is not None:
                    self.run_window_chained(pending[w : w + step], chains)
                else:
                    self.run_window(pending[w : w + step])
        except KeyboardInterrupt:
            self.keep_open("interrupted")
            raise
        except _TimeUp:
            assert self.deadline is not None
            self.keep_open(f"stopped at the time limit ({self.deadline - self.t0:g} s)")
            self.report.time_limit_reached = True
        finally:
            self.writer.f.close()
            self.bar.close()
            if self.rewrote:
                compact(self.writer.path)

    def keep_open(self, why: str) -> None:
        """On an interrupt or at the time limit: write every open conversation with the turns
        it has answered.

        Why: a time-limited job (SIGINT at the limit) would otherwise lose every conversation
        still in flight, which with whole conversations as chains is most of the work. The
        record is a valid shorter conversation, marked `open`; a rerun continues it."""
        for s in self.open_states:
            answered = sum(m["role"] == "assistant" for m in s.messages)
            if s.written or not s.finish_reasons or answered != len(s.finish_reasons):
                continue  # nothing answered, or interrupted between a turn's two updates
            if s.resumed_turns == answered:
                continue  # continued, nothing new: its earlier record stands as it is
            self.report.cut_at_interrupt += 1
            self._finish(s, open_turns=True)
        print(
            f"dflash data regenerate: {why}; wrote the answered turns of "
            f"{self.report.cut_at_interrupt} open conversations ({self.report.written} records "
            f"in all, {self.report.new_tokens:,} new tokens)",
            file=sys.stderr,
        )

    def _check_time(self) -> None:
        if self.deadline is not None and time.perf_counter() > self.deadline:
            raise _TimeUp

    def _ids(self, text: str) -> list[int]:
        if self.tokens is None:
            self.tokens = SegmentTokenizer(self.chat.tokenizer)
        return self.tokens(text)

    def start(self, conv: Conversation) -> _State:
        head = [m for m in conv.messages[:1] if m["role"] == "system"]
        users = [m["content"] for m in conv.messages if m["role"] == "user"]
        users = users[: self.max_turns] if self.max_turns else users
        rec = self.resume.pop(conv.id, None)
        if rec is None:
            return _State(conv, users, list(head))
        gen = rec["generation"]  # checked by _continues
        k = len(gen["finish_reasons"])
        return _State(
            conv,
            users[k:],
            list(rec["messages"]),
            list(gen["finish_reasons"]),
            list(gen["completion_tokens"]),
            resumed_turns=k,
        )

    def run_window(self, convs: list[Conversation]) -> None:
        """Round r answers turn r of every unfinished conversation, shortest prompts first."""
        active = [self.start(c) for c in convs]
        self.open_states = list(active)
        while active:
            ready = [s for s in active if self._prompt_fits(s)]
            ready.sort(key=lambda s: len(s.prompt or ()))
            chunk = self.generator.max_batch or len(ready) or 1
            active = []
            for i in range(0, len(ready), chunk):
                batch = ready[i : i + chunk]
                outs = self.generator.generate([self._request(s) for s in batch])
                for s, new_ids in zip(batch, outs):
                    if new_ids is None:
                        self._unanswered(s)
                        continue
                    self._answer(s, new_ids)
                    if not self._within_budget(s):
                        continue
                    if s.users:
                        active.append(s)
                    else:
                        self._finish(s)
                self._show_speed()
                self._check_time()

    def run_window_chained(self, convs: list[Conversation], chains: Any) -> None:
        """Every conversation as one chain of turns on an engine that queues a conversation's
        next turn as soon as its answer is in (no rounds); a turn's sampling key is
        (seed, conversation id, turn), whatever ran beside it."""
        from dflash_trainer.data.sampling import item_key

        states = [self.start(c) for c in convs]
        self.open_states = states
        ready = [s for s in states if self._prompt_fits(s)]

        def key(s: _State) -> int:
            return item_key(self.seed, s.conv.id, len(s.finish_reasons))

        def follow(chain: int, new_ids: list[int] | None) -> tuple[Any, int] | None:
            s = ready[chain]
            if new_ids is None:
                self._unanswered(s)
                self._check_time()
                return None
            self._answer(s, new_ids)
            self._show_speed()
            nxt = None
            if self._within_budget(s):
                if not s.users:
                    self._finish(s)
                elif self._prompt_fits(s):
                    nxt = (self._request(s), key(s))
            self._check_time()
            return nxt

        chains([(self._request(s), key(s)) for s in ready], follow)

    def _show_speed(self) -> None:
        now = time.perf_counter()
        rate = self.report.new_tokens / max(now - self.t0, 1e-9)
        self.bar.set_postfix(tok_s=f"{rate:.0f}", refresh=False)
        if self.bar.disable and now - self.last_line >= 60:  # --no-progress: a line a minute
            self.last_line = now
            r = self.report
            print(
                f"dflash data regenerate: {now - self.t0:.0f} s, {r.written} conversations "
                f"written, {r.new_tokens:,} new tokens ({rate:,.0f}/s)",
                file=sys.stderr,
                flush=True,
            )

    def _prompt_fits(self, s: _State) -> bool:
        turn = {"role": "user", "content": s.users[0]}
        s.prompt = self._ids(self.chat.render([*s.messages, turn], add_generation_prompt=True))
        budget = self.max_conversation_tokens
        if budget is not None and len(s.prompt) >= budget:  # no room left for an answer
            self._over_budget(s)
            return False
        if self.max_prompt_tokens is None or len(s.prompt) <= self.max_prompt_tokens:
            return True
        if s.finish_reasons:  # the history grew too long: keep the turns answered so far
            self.report.truncated_at_prompt_limit += 1
            self._finish(s)
        else:
            self.report.skipped_prompt_too_long += 1
            self.bar.update(1)
        return False

    def _request(self, s: _State) -> Any:
        """What the generator is asked: the rendered prompt's ids, or the messages for a
        backend that renders the chat itself (a server's chat endpoint)."""
        if getattr(self.generator, "takes_messages", False):
            return [*s.messages, {"role": "user", "content": s.users[0]}]
        return s.prompt or []

    def _unanswered(self, s: _State) -> None:
        """The backend could not answer s's next turn: the conversation ends here for this
        job, kept open with the turns it has (a rerun continues it; nothing is written when
        it has no turn of its own yet)."""
        self.report.not_answered += 1
        s.users.clear()
        if s.finish_reasons and s.resumed_turns != len(s.finish_reasons):
            self._finish(s, open_turns=True)
        else:  # nothing new: an earlier record, if any, stands
            self.bar.update(1)

    def _answer(self, s: _State, new_ids: list[int]) -> None:
        content_ids, reason, n = cut_at_stop(new_ids, self.stops, self.stop_loops)
        text = self.chat.tokenizer.decode(content_ids, skip_special_tokens=True)
        s.messages += [
            {"role": "user", "content": s.users.pop(0)},
            {"role": "assistant", "content": text},
        ]
        s.finish_reasons.append(reason)
        s.completion_tokens.append(n)
        self.report.new_tokens += n

    def _within_budget(self, s: _State) -> bool:
        """False (and the conversation ended) when the answered turn overflowed the budget."""
        budget = self.max_conversation_tokens
        if budget is None:
            return True
        text = self.chat.render(s.messages)
        if len(self._ids(text)) <= budget:
            return True
        del s.messages[-2:]  # the turn that did not fit: the conversation ends before it
        s.finish_reasons.pop()
        s.completion_tokens.pop()
        self._over_budget(s)
        return False

    def _over_budget(self, s: _State) -> None:
        s.users.clear()
        if s.finish_reasons:
            self.report.cut_at_conversation_limit += 1
            self._finish(s)
        else:
            self.report.skipped_conversation_too_long += 1
            self.bar.update(1)

    def _finish(self, s: _State, open_turns: bool = False) -> None:
        s.written = True
        self.writer.write(s.conv.id, s.messages, s.finish_reasons, s.completion_tokens, open_turns)
        self.report.written += 1
        self.rewrote += s.resumed_turns is not None
        for r in s.finish_reasons[s.resumed_turns or 0 :]:  # the turns this job answered
            self.report.finish_reasons[r] = self.report.finish_reasons.get(r, 0) + 1
        self.bar.update(1)
