"""A real OpenAI-compatible HTTP server for the tests (no tests here): the standard library's
http.server in a thread, answering with a real HF model's `generate`.

Greedy at temperature 0; sampled with torch seeded by the request's `seed`, as
synthesize.KeyedHFGenerator samples, so a seeded request gives the draw the built-in HF path
gives for the same key. vLLM's extensions are honoured: `stop_token_ids`, `return_token_ids`
(the generated ids, the stop token included, as vLLM returns them), `chat_template_kwargs`.

Hostile behaviour is scripted with `Fault`s, matched against the decoded prompt:
"500" / "400" (that status), "429" (with Retry-After), "garbage" (a 200 whose body is not
JSON), "close" (the connection closed without an answer), "slow" (the answer after
`slow_seconds`), "short" (half the answer, finish reason length).
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import torch


@dataclass
class Fault:
    kind: str
    match: str = ""
    """Applies to requests whose decoded prompt contains this text ("" : any)."""
    times: int = 1


@dataclass
class ServerState:
    model: Any
    tokenizer: Any
    name: str = "tiny"
    token_ids: bool = True
    """Return the generated ids (vLLM's return_token_ids); False: text only."""
    faults: list[Fault] = field(default_factory=list)
    retry_after: str = "0.3"
    slow_seconds: float = 1.0
    requests: list[dict[str, Any]] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def fault_for(self, prompt_text: str) -> str | None:
        with self.lock:
            for f in self.faults:
                if f.times > 0 and f.match in prompt_text:
                    f.times -= 1
                    return f.kind
        return None


def _stops(state: ServerState, body: dict[str, Any]) -> list[int]:
    """As vLLM stops: at the ids asked for and at every EOS the model declares."""
    declared = state.model.generation_config.eos_token_id
    declared = declared if isinstance(declared, list) else [declared]
    asked = body.get("stop_token_ids") or [state.tokenizer.eos_token_id]
    return sorted(set(asked) | {i for i in declared if i is not None})


def _generate(state: ServerState, ids: list[int], body: dict[str, Any]) -> list[int]:
    from transformers import GenerationConfig

    model = state.model
    stops = _stops(state, body)
    temperature = float(body.get("temperature") or 0.0)
    sampling = temperature > 0
    config = GenerationConfig(
        max_new_tokens=int(body.get("max_tokens", 16)),
        do_sample=sampling,
        temperature=temperature if sampling else None,
        top_p=float(body.get("top_p", 1.0)) if sampling else None,
        top_k=0 if sampling else None,
        eos_token_id=stops,
        pad_token_id=state.tokenizer.pad_token_id,
    )
    with state.lock, torch.inference_mode():  # one generate at a time: torch's RNG is global
        if sampling:
            torch.manual_seed(int(body.get("seed") or 0))
        x = torch.tensor([ids], dtype=torch.long)
        out = model.generate(x, attention_mask=torch.ones_like(x), generation_config=config)
    return list(out[0, len(ids) :].tolist())


def _answer(state: ServerState, chat: bool, body: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """(the fault to play or "", the completion body)."""
    tok = state.tokenizer
    if chat:
        kwargs = body.get("chat_template_kwargs") or {}
        text = tok.apply_chat_template(
            body["messages"], tokenize=False, add_generation_prompt=True, **kwargs
        )
        ids = list(tok(text, add_special_tokens=False)["input_ids"])
    else:
        prompt = body["prompt"]
        ids = list(prompt) if isinstance(prompt, list) else tok(prompt)["input_ids"]
        text = tok.decode(ids)
    fault = state.fault_for(text) or ""
    if fault in ("500", "400", "429", "garbage", "close"):
        return fault, {}
    new = _generate(state, ids, body)
    stops = set(_stops(state, body))
    reason = "stop" if new and new[-1] in stops else "length"
    if fault == "short" and len(new) > 1:
        new, reason = new[: len(new) // 2], "length"
    content = tok.decode([t for t in new if t not in stops], skip_special_tokens=True)
    choice: dict[str, Any] = {"index": 0, "finish_reason": reason}
    choice |= {"message": {"role": "assistant", "content": content}} if chat else {"text": content}
    if state.token_ids and body.get("return_token_ids"):
        choice["token_ids"] = new
    usage = {"prompt_tokens": len(ids), "completion_tokens": len(new)}
    return fault, {"id": "x", "object": "completion", "choices": [choice], "usage": usage}


def _handler(state: ServerState) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args: Any) -> None:  # quiet test output
            pass

        def _send(self, code: int, payload: bytes, headers: dict[str, str] | None = None) -> None:
            self.send_response(code)
            for k, v in (headers or {}).items():
                self.send_header(k, v)
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)

        def do_GET(self) -> None:
            if self.path.rstrip("/") == "/v1/models":
                self._send(200, json.dumps({"data": [{"id": state.name}]}).encode())
            else:
                self._send(404, b"{}")

        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            state.requests.append(body)
            chat = self.path.rstrip("/") == "/v1/chat/completions"
            if not chat and self.path.rstrip("/") != "/v1/completions":
                self._send(404, b"{}")
                return
            fault, answer = _answer(state, chat, body)
            try:
                if fault == "close":
                    self.close_connection = True
                elif fault == "garbage":
                    self._send(200, b'{"choices": [ not json')
                elif fault == "429":
                    self._send(429, b"{}", {"Retry-After": state.retry_after})
                elif fault in ("500", "400"):
                    self._send(int(fault), b'{"error": "scripted"}')
                else:
                    if fault == "slow":
                        time.sleep(state.slow_seconds)
                    self._send(200, json.dumps(answer).encode())
            except (BrokenPipeError, ConnectionResetError):
                pass  # the client gave up on a slow answer

    return Handler


class OpenAITestServer:
    """`with OpenAITestServer(state) as url:` serves on 127.0.0.1 at a free port."""

    def __init__(self, state: ServerState) -> None:
        self.state = state
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), _handler(state))
        self.httpd.daemon_threads = True
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"

    def __enter__(self) -> str:
        self.thread.start()
        return self.url

    def __exit__(self, *exc: object) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self.thread.join()
