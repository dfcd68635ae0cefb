"""Regeneration and synthesis through an OpenAI-compatible server (`--backend openai`).

Why: a big target is served on a cluster (vLLM, SGLang) long before anyone loads it in
this process; its answers are what the drafter must learn. The job is the built-in engine's
job (data/regenerate.py: prompts rendered and measured here, records written, resumed and
continued the same way); only the tokens come from the server.

Requests:
- completions endpoint (default): the prompt is sent as the token ids rendered here, so the
  server continues exactly the prompt the built-in engine would have; chat endpoint: the
  messages are sent and the server renders its own chat template (enable_thinking passed as
  a chat template argument).
- greedy or sampled with a per-request seed: a conversation's turn t is seeded with
  item_key(seed, conversation id, t) (synthesis: item_key(seed, item)), so a rerun asks for
  the same draw whatever else was in flight (when the server honours seeds).
- the stop ids, `return_token_ids` and an unbounded top_k are sent as the extensions vLLM
  and SGLang accept; `plain` leaves them out for a server that refuses unknown fields.
- at most `concurrency` requests in flight; a conversation's next turn is sent as soon as
  its answer is in (no rounds waiting for the slowest answer).

Answers become token ids: the server's own ids when it returns them, else the text
tokenized here (exact where the tokenizer round trip is). A stop answer that does not end in
a stop id gets one, so the record counts the stop token like the built-in engine does. An
answer cut by length before max_new_tokens (a server's context limit), one with another
finish reason, or a request that failed after the retries is not used: None goes back to the
job, which keeps the conversation's answered turns open for a rerun (data/openai_client.py
counts every case).
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Any

from dflash_trainer import cli_numbers as num
from dflash_trainer.data.openai_client import ENDPOINTS, Answer, OpenAIClient
from dflash_trainer.data.sampling import item_key
from dflash_trainer.data.settings import GenerationSettings
from dflash_trainer.errors import DFlashError

Prompt = list[int] | list[dict[str, str]]
"""Token ids (completions endpoint) or messages (chat endpoint)."""
Follow = Callable[[int, list[int] | None], tuple[Prompt, int] | None]


class OpenAIGenerator:
    """Regeneration's `Generator` (and synthesis's) over an OpenAI-compatible server."""

    max_batch: int | None = None  # the whole round: concurrency is bounded here

    def __init__(
        self,
        client: OpenAIClient,
        settings: GenerationSettings,
        stops: list[int],
        tokenizer: Any,
        endpoint: str = "completions",
        concurrency: int = 8,
        plain: bool = False,
    ) -> None:
        if endpoint not in ENDPOINTS:
            raise DFlashError(f"--endpoint {endpoint!r}: use one of {list(ENDPOINTS)}")
        if concurrency < 1:
            raise DFlashError(f"--concurrency {concurrency}: give at least 1")
        self.client, self.settings, self.stops = client, settings, stops
        self.tokenizer, self.endpoint = tokenizer, endpoint
        self.concurrency, self.plain = concurrency, plain
        self.takes_messages = endpoint == "chat"
        self.server_stats = client.stats

    def generate(
        self, prompts: Sequence[Prompt], keys: list[int] | None = None
    ) -> list[list[int] | None]:
        """Token ids per prompt (None: not answered); keys seed the requests (default: the
        job's seed and the prompt's index)."""
        if keys is None:
            keys = [item_key(self.settings.seed, i) for i in range(len(prompts))]
        with ThreadPoolExecutor(self.concurrency, thread_name_prefix="openai") as pool:
            return list(pool.map(self.ask, prompts, keys))

    def generate_chains(self, first: list[tuple[Prompt, int]], follow: Follow) -> None:
        """Chains of requests (a conversation's turns): `follow(chain, ids or None)` gets each
        answer in this thread and returns the chain's next (prompt, key) or None. Requests
        not yet sent are cancelled when `follow` raises (time limit, Ctrl-C); the answers of
        those in flight are dropped."""
        pool = ThreadPoolExecutor(self.concurrency, thread_name_prefix="openai")
        running: dict[Future[list[int] | None], int] = {}
        try:
            for chain, (prompt, key) in enumerate(first):
                running[pool.submit(self.ask, prompt, key)] = chain
            while running:
                done, _ = wait(running, return_when=FIRST_COMPLETED)
                for fut in done:
                    chain = running.pop(fut)
                    nxt = follow(chain, fut.result())
                    if nxt is not None:
                        running[pool.submit(self.ask, *nxt)] = chain
        finally:  # on an interrupt, do not wait for the requests in flight to time out
            pool.shutdown(wait=False, cancel_futures=True)

    def ask(self, prompt: Prompt, key: int) -> list[int] | None:
        """One request: the answer's token ids, or None (counted by the client)."""
        answer = self.client.complete(self.endpoint, self.body(prompt, key))
        return None if answer is None else self.token_ids(answer)

    def body(self, prompt: Prompt, key: int) -> dict[str, Any]:
        s = self.settings
        body: dict[str, Any] = {
            "max_tokens": s.max_new_tokens,
            "temperature": s.temperature,
            "top_p": s.top_p,
            "seed": key,
        }
        if prompt and isinstance(prompt[0], dict):
            if self.endpoint != "chat":
                raise DFlashError("messages need the chat endpoint (--endpoint chat)")
            body["messages"] = prompt
            if s.enable_thinking is not None and not self.plain:
                body["chat_template_kwargs"] = {"enable_thinking": s.enable_thinking}
        else:
            if self.endpoint != "completions":
                raise DFlashError("a token prompt needs the completions endpoint")
            body["prompt"] = list(prompt)
        if not self.plain:
            body |= {"stop_token_ids": self.stops, "return_token_ids": True, "top_k": -1}
        return body

    def token_ids(self, a: Answer) -> list[int] | None:
        """The answer as the job's token ids (module docstring), or None when unusable."""
        stats, new = self.client.stats, self.settings.max_new_tokens
        if a.finish_reason not in ("stop", "length"):
            self.client._count("other_finish", a.finish_reason)
            return None
        ids = a.token_ids
        if ids is None:
            ids = list(self.tokenizer(a.text, add_special_tokens=False)["input_ids"])
            self.client._count("retokenized")
        count = a.completion_tokens if a.completion_tokens is not None else len(ids)
        stop_set = set(self.stops)
        if a.finish_reason == "length" and count < new and not stop_set & set(ids):
            self.client._count("short_answers")
            return None
        if a.finish_reason == "stop" and not stop_set & set(ids):
            ids = [*self._content(ids, a.text), self.stops[0]]
        with self.client._lock:
            stats.completion_tokens += count
        return ids[: new + 1]

    def _content(self, ids: list[int], text: str) -> list[int]:
        """The content ids of a stop answer none of whose ids is one of our stop ids: the
        server stopped at its own (an EOS the model declares beyond its tokenizer's). Its
        last id is that stop token when the text is complete without it."""
        if ids and self.tokenizer.decode(ids[:-1], skip_special_tokens=True) == text:
            return ids[:-1]
        return ids


def add_server_arguments(p: argparse.ArgumentParser) -> None:
    """The options of `--backend openai`, the same on `regenerate` and `synthesize`."""
    g = p.add_argument_group("--backend openai (an OpenAI-compatible server; docs/serving.md)")
    g.add_argument("--base-url", help="the server's API root, e.g. http://127.0.0.1:8000/v1")
    g.add_argument(
        "--endpoint",
        choices=ENDPOINTS,
        default="completions",
        help="completions: token prompts rendered here (exact); chat: messages, the server's "
        "chat template",
    )
    g.add_argument("--concurrency", type=num.count(1, 4096), default=8, help="requests in flight")
    g.add_argument(
        "--timeout", type=num.positive(86400.0), default=600.0, help="seconds per request"
    )
    g.add_argument(
        "--retries", type=num.integer(0, 100), default=5, help="tries after the first on 429/5xx"
    )
    g.add_argument(
        "--api-key-env",
        metavar="VAR",
        help="send the key in this environment variable as a bearer token (default: none)",
    )
    g.add_argument(
        "--plain-openai",
        action="store_true",
        help="send only standard OpenAI fields (no stop_token_ids / return_token_ids / top_k)",
    )


@dataclass(frozen=True)
class ServerOptions:
    """Where and how to ask: what `--backend openai` needs besides the job's settings."""

    client: OpenAIClient
    endpoint: str = "completions"
    concurrency: int = 8
    plain: bool = False

    def generator(
        self, settings: GenerationSettings, stops: list[int], tokenizer: Any
    ) -> OpenAIGenerator:
        return OpenAIGenerator(
            self.client, settings, stops, tokenizer, self.endpoint, self.concurrency, self.plain
        )


def server_from_args(args: argparse.Namespace) -> ServerOptions:
    """The server the command line names, checked to serve --model."""
    if not args.base_url:
        raise DFlashError("--backend openai needs --base-url (e.g. http://127.0.0.1:8000/v1)")
    key = None
    if args.api_key_env:
        key = os.environ.get(args.api_key_env)
        if not key:
            raise DFlashError(f"--api-key-env {args.api_key_env}: that variable is not set")
    if args.retries < 0 or not args.timeout > 0:
        raise DFlashError("--retries must be >= 0 and --timeout > 0")
    client = OpenAIClient(args.base_url, args.model, args.timeout, args.retries, api_key=key)
    client.check_model()
    return ServerOptions(client, args.endpoint, args.concurrency, args.plain_openai)


def server_line(stats: dict[str, Any]) -> str:
    """One line of a job's ServerStats: what the server answered and what it failed."""
    errors = ", ".join(f"{k}: {v}" for k, v in sorted(stats["http_errors"].items())) or "none"
    return (
        f"server: {stats['answered']} answers of {stats['requests']} requests "
        f"({stats['retries']} retries; HTTP errors {errors}; {stats['timeouts']} timeouts, "
        f"{stats['dropped_connections']} dropped connections, {stats['garbage']} garbage "
        f"answers, {stats['rejected']} refused); {stats['failed']} requests failed, "
        f"{stats['short_answers']} short answers and {sum(stats['other_finish'].values())} "
        f"other finishes not used; {stats['retokenized']} answers tokenized from text; "
        f"{stats['completion_tokens']} completion tokens by the server's count"
    )
