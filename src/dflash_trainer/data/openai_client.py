"""A small client of OpenAI-compatible servers (vLLM, SGLang, llama.cpp, TGI, ...): the
standard library only, safe to call from many threads.

What a regeneration job needs of a server, and nothing more: one completion or chat
completion per request, retried when the failure is the server's or the network's (429 and
5xx answers, honouring Retry-After; timeouts; dropped connections; a body that is not the
JSON of a completion), refused at once when it is the request's (any other 4xx). Every
outcome is counted in `ServerStats`; a request that still fails after the retries returns
None, never raises, so one bad answer costs one conversation, not the job.
"""

from __future__ import annotations

import http.client
import json
import random
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from typing import Any

from dflash_trainer.errors import DFlashError

ENDPOINTS = ("completions", "chat")
_RETRY_STATUS = frozenset({408, 409, 425, 429}) | frozenset(range(500, 600))


@dataclass
class ServerStats:
    """What the server did, over every request of a job."""

    requests: int = 0
    """Requests sent, retries included."""
    answered: int = 0
    retries: int = 0
    http_errors: dict[str, int] = field(default_factory=dict)
    """HTTP status -> answers with that error status."""
    timeouts: int = 0
    dropped_connections: int = 0
    garbage: int = 0
    """Answers that were not the JSON of a completion (or named no finish reason)."""
    rejected: int = 0
    """Requests the server refused (4xx other than 429): not retried."""
    failed: int = 0
    """Requests given up after the retries (or rejected): their conversations wait for a rerun."""
    short_answers: int = 0
    """Answers cut by length before max_new_tokens: not used (a rerun asks again)."""
    other_finish: dict[str, int] = field(default_factory=dict)
    """Finish reasons other than stop and length (e.g. abort): not used."""
    retokenized: int = 0
    """Answers whose token ids were rebuilt from their text (the server returned none)."""
    completion_tokens: int = 0
    """The server's own count (usage.completion_tokens) over the answers used."""


class _Retry(Exception):
    """A failure worth another try (after `wait` seconds, when the server said so)."""

    def __init__(self, kind: str, wait: float | None = None) -> None:
        super().__init__(kind)
        self.kind, self.wait = kind, wait


@dataclass(frozen=True)
class Answer:
    text: str
    finish_reason: str
    token_ids: list[int] | None
    """The generated ids when the server returns them (vLLM/SGLang `return_token_ids`)."""
    completion_tokens: int | None


class OpenAIClient:
    """POSTs to `<base_url>/completions` or `/chat/completions` with retries and backoff."""

    def __init__(
        self,
        base_url: str,
        model: str,
        timeout: float = 600.0,
        retries: int = 5,
        backoff: float = 1.0,
        max_backoff: float = 60.0,
        api_key: str | None = None,
    ) -> None:
        self.base_url = normalise_base_url(base_url)
        self.model, self.timeout = model, timeout
        self.retries, self.backoff, self.max_backoff = retries, backoff, max_backoff
        self.api_key = api_key
        self.stats = ServerStats()
        self._lock = threading.Lock()

    def _count(self, name: str, key: str | None = None) -> None:
        with self._lock:
            if key is None:
                setattr(self.stats, name, getattr(self.stats, name) + 1)
            else:
                d = getattr(self.stats, name)
                d[key] = d.get(key, 0) + 1

    def _headers(self) -> dict[str, str]:
        h = {"Content-Type": "application/json", "Accept": "application/json"}
        if self.api_key:
            h["Authorization"] = f"Bearer {self.api_key}"
        return h

    def get_json(self, path: str, timeout: float = 10.0) -> Any:
        """One GET (no retries): for the checks made before a job starts."""
        req = urllib.request.Request(self.base_url + path, headers=self._headers())
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return json.loads(resp.read())

    def check_model(self) -> list[str]:
        """The models the server lists; a clear error when it is unreachable or does not
        serve `model` (a wrong URL would otherwise fail every request of the job)."""
        try:
            listing = self.get_json("/models")
            served = [str(m["id"]) for m in listing["data"]]
        except (OSError, http.client.HTTPException, ValueError, KeyError, TypeError) as e:
            raise DFlashError(
                f"no OpenAI-compatible server answers at {self.base_url} ({e}); start one "
                "(docs/serving.md) or pass the right --base-url (it ends in /v1)"
            ) from e
        if self.model not in served:
            raise DFlashError(
                f"the server at {self.base_url} serves {served}, not {self.model!r}; pass one "
                "of those as --model"
            )
        return served

    def complete(self, endpoint: str, body: dict[str, Any]) -> Answer | None:
        """The answer to one request, or None once the retries are spent (counted)."""
        path = "/chat/completions" if endpoint == "chat" else "/completions"
        payload = json.dumps({"model": self.model, **body}).encode()
        for attempt in range(self.retries + 1):
            if attempt:
                self._count("retries")
            try:
                answer = self._post(path, payload, endpoint)
            except _Retry as r:
                if attempt == self.retries:
                    break
                time.sleep(self._delay(attempt, r.wait))
                continue
            if answer is None:  # refused: the same request would be refused again
                break
            self._count("answered")
            return answer
        self._count("failed")
        return None

    def _delay(self, attempt: int, asked: float | None) -> float:
        """Exponential backoff with jitter (so many threads do not retry in step); a
        server's Retry-After wins when it asks for longer."""
        own = min(self.max_backoff, self.backoff * 2**attempt) * (0.5 + random.random() / 2)
        return max(own, min(asked, self.max_backoff)) if asked is not None else own

    def _post(self, path: str, payload: bytes, endpoint: str) -> Answer | None:
        self._count("requests")
        req = urllib.request.Request(
            self.base_url + path, data=payload, headers=self._headers(), method="POST"
        )
        try:
            with urllib.request.urlopen(req, timeout=self.timeout) as resp:
                raw = resp.read()
        except urllib.error.HTTPError as e:
            self._count("http_errors", str(e.code))
            if e.code in _RETRY_STATUS:
                raise _Retry(f"http {e.code}", retry_after(e.headers.get("Retry-After"))) from e
            self._count("rejected")
            return None
        except TimeoutError as e:
            self._count("timeouts")
            raise _Retry("timeout") from e
        except urllib.error.URLError as e:
            if isinstance(e.reason, TimeoutError):
                self._count("timeouts")
                raise _Retry("timeout") from e
            self._count("dropped_connections")
            raise _Retry("connection") from e
        except (http.client.HTTPException, ConnectionError) as e:
            self._count("dropped_connections")
            raise _Retry("connection") from e
        answer = parse_answer(raw, endpoint)
        if answer is None:
            self._count("garbage")
            raise _Retry("garbage")
        return answer


def parse_answer(raw: bytes, endpoint: str) -> Answer | None:
    """The first choice of a completion body, or None when the body is not one."""
    try:
        body = json.loads(raw)
        choice = body["choices"][0]
        text = choice["message"]["content"] if endpoint == "chat" else choice["text"]
        reason = choice["finish_reason"]
        ids = choice.get("token_ids")
        usage = body.get("usage") or {}
        count = usage.get("completion_tokens")
    except (ValueError, KeyError, IndexError, TypeError, RecursionError):
        return None
    ids_ok = ids is None or (isinstance(ids, list) and all(type(t) is int for t in ids))
    if not isinstance(text, str) or not isinstance(reason, str) or not ids_ok:
        return None
    return Answer(text, reason, ids, count if type(count) is int else None)


def retry_after(value: str | None) -> float | None:
    """Seconds from a Retry-After header (seconds; an HTTP date is taken as 'soon')."""
    if value is None:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        return None


def normalise_base_url(url: str) -> str:
    """`http://host:port/v1` without a trailing slash; other schemes are refused."""
    url = url.strip().rstrip("/")
    if not url.startswith(("http://", "https://")):
        raise DFlashError(f"--base-url {url!r}: give an http:// or https:// URL ending in /v1")
    return url
