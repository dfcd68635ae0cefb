"""`dflash serve-check`'s parts that need no vLLM: the counters page, the comparison, serving
conversations through a real OpenAI-compatible server, and the server process's lifecycle
(a real process tree: a small HTTP server that forks a child, started and reaped the way
vLLM is). tests/test_served_vllm.py runs the whole check on vLLM itself."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from openai_test_server import OpenAITestServer, ServerState
from test_data_support import tiny_llama, tiny_tokenizer

from dflash_trainer.data.openai_client import OpenAIClient
from dflash_trainer.errors import DFlashError
from dflash_trainer.serve.metrics import SpecCounters, parse_spec_counters
from dflash_trainer.serve.served import compare_set, eval_texts, serve_conversations
from dflash_trainer.serve.vllm_server import VLLMServer, group_alive

pytestmark = pytest.mark.usefixtures("one_thread")

# The lines vLLM 0.32 writes (two engines' label sets, to check they are summed).
METRICS = """\
# HELP vllm:spec_decode_num_drafts_total Number of spec decoding drafts.
# TYPE vllm:spec_decode_num_drafts_total counter
vllm:spec_decode_num_drafts_total{engine="0",model_name="smol"} 85.0
vllm:spec_decode_num_drafts_total{engine="1",model_name="smol"} 15.0
vllm:spec_decode_num_drafts_created{engine="0",model_name="smol"} 1.7965145161389682e+09
vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="smol"} 1500.0
vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="smol"} 109.0
vllm:spec_decode_num_accepted_tokens_total{engine="1",model_name="smol"} 11.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="smol",position="0"} 60.0
"""


def test_counters_are_summed_over_engines_and_differenced() -> None:
    c = parse_spec_counters(METRICS)
    assert c == SpecCounters(100.0, 1500.0, 120.0)
    assert c.tau == pytest.approx(2.2)
    assert (c - SpecCounters(50.0, 750.0, 20.0)).tau == pytest.approx(3.0)
    assert SpecCounters().tau is None
    assert parse_spec_counters("vllm:num_requests_running 0.0\n") is None


def test_the_comparison_groups_turns_per_conversation() -> None:
    responses = [
        {"prompt": "b", "turn": 1, "text": "b2"},
        {"prompt": "a", "turn": 0, "text": "a1"},
        {"prompt": "b", "turn": 0, "text": "b1"},
    ]
    assert eval_texts(responses, ["a", "b"]) == [["a1"], ["b1", "b2"]]
    from dflash_trainer.serve.served import ServedSet

    served = ServedSet([["a1"], ["b1", "other"]], SpecCounters(10.0, 150.0, 12.0))
    evaluated = {"responses": responses, "tau_pooled": 2.25, "tau": 2.4, "lossless_mismatches": 0}
    got = compare_set(served, evaluated, ["a", "b"])
    assert (got["greedy_equal"], got["prompts"], got["turns_equal"], got["turns"]) == (1, 2, 2, 3)
    assert got["vllm_tau"] == pytest.approx(2.2) and got["dflash_eval_tau"] == 2.25


def test_conversations_are_served_turn_by_turn_as_the_target_answers_them() -> None:
    import torch

    tok = tiny_tokenizer()
    model = tiny_llama(len(tok))
    convs = [
        [{"role": "user", "content": "question one"}],
        [{"role": "user", "content": "first turn"}, {"role": "user", "content": "second"}],
    ]
    with OpenAITestServer(ServerState(model, tok)) as url:
        served = serve_conversations(OpenAIClient(url, "tiny"), tok, convs, 6, [2])
    assert served.failed == 0 and [len(t) for t in served.texts] == [1, 2]
    history: list[dict[str, str]] = []
    for msg, answer in zip(convs[1], served.texts[1]):  # the target's own greedy turns
        history.append(msg)
        text = tok.apply_chat_template(history, tokenize=False, add_generation_prompt=True)
        ids = torch.tensor([tok(text, add_special_tokens=False)["input_ids"]])
        out = model.generate(ids, max_new_tokens=6, do_sample=False, eos_token_id=[2])
        assert answer == tok.decode(out[0, ids.shape[1] :], skip_special_tokens=True)
        history.append({"role": "assistant", "content": answer})


# A stand-in server process: serves /v1/models on the port it is given and forks a child
# that sleeps, as vLLM's API server forks its engine.
FORKING_SERVER = textwrap.dedent(
    """
    import http.server, json, subprocess, sys
    port = int(sys.argv[sys.argv.index("--port") + 1])
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    open(sys.argv[sys.argv.index("--child-file") + 1], "w").write(str(child.pid))
    class H(http.server.BaseHTTPRequestHandler):
        def log_message(self, *a): pass
        def do_GET(self):
            body = json.dumps({"data": [{"id": "m"}]}).encode()
            self.send_response(200); self.send_header("Content-Length", str(len(body)))
            self.end_headers(); self.wfile.write(body)
    http.server.HTTPServer(("127.0.0.1", port), H).serve_forever()
    """
)


def _forking(tmp_path: Path) -> VLLMServer:
    script = tmp_path / "server.py"
    script.write_text(FORKING_SERVER)
    server = VLLMServer(Path(sys.executable), "m", "m", log_path=tmp_path / "log")
    server.command = [sys.executable, str(script), "--port", str(server.port)]
    server.command += ["--child-file", str(tmp_path / "child")]
    return server


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}").exists() and "Z" not in _state(pid)


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0]
    except OSError:
        return "Z"


def test_the_server_and_its_children_are_gone_after_the_block_and_after_an_error(
    tmp_path: Path,
) -> None:
    server = _forking(tmp_path)
    seen: list[int] = []

    def check_then_fail() -> None:
        with server:
            assert server.proc is not None
            seen.extend([server.proc.pid, int((tmp_path / "child").read_text())])
            assert group_alive(seen[0]) and _pid_alive(seen[1])
            raise RuntimeError("mid-check")

    with pytest.raises(RuntimeError, match="mid-check"):
        check_then_fail()
    pgid, child = seen
    assert not group_alive(pgid) and not _pid_alive(child)
    assert server.proc.returncode is not None  # reaped: no zombie left


def test_an_early_exit_is_an_error_that_shows_the_log(tmp_path: Path) -> None:
    server = VLLMServer(Path(sys.executable), "m", "m", log_path=tmp_path / "log")
    server.command = [sys.executable, "-c", "print('no such model'); raise SystemExit(3)"]
    with pytest.raises(DFlashError, match=r"(?s)status 3.*no such model"):
        server.start(timeout=60)
    assert server.proc is not None and server.proc.returncode == 3


def test_a_terminated_parent_takes_its_server_with_it(tmp_path: Path) -> None:
    """SIGTERM to the process that started the server (a job killed by its scheduler)."""
    script = tmp_path / "server.py"
    script.write_text(FORKING_SERVER)
    parent = textwrap.dedent(
        f"""
        import sys, time
        from pathlib import Path
        from dflash_trainer.serve.vllm_server import VLLMServer
        s = VLLMServer(Path(sys.executable), "m", "m")
        s.command = [sys.executable, {str(script)!r}, "--port", str(s.port),
                     "--child-file", {str(tmp_path / "child")!r}]
        s.start(timeout=60)
        print(s.proc.pid, flush=True)
        time.sleep(600)
        """
    )
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[1] / "src")}
    proc = subprocess.Popen(
        [sys.executable, "-c", parent], stdout=subprocess.PIPE, text=True, env=env
    )
    try:
        assert proc.stdout is not None
        pgid = int(proc.stdout.readline())
        child = int((tmp_path / "child").read_text())
        assert group_alive(pgid)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == -signal.SIGTERM
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    deadline = time.monotonic() + 10
    while (group_alive(pgid) or _pid_alive(child)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not group_alive(pgid) and not _pid_alive(child)


def test_the_card_prints_the_command_serve_check_runs() -> None:
    from conftest import make_spec

    from dflash_trainer.formats.card import serve_commands

    cmds = serve_commands("zlab", "OUT", "o/t", make_spec(block=16))
    cpu = cmds["vLLM, CPU build (what `dflash serve-check` runs)"]
    assert cpu.startswith("python -m vllm.entrypoints.openai.api_server --model o/t")
    assert '"num_speculative_tokens": 15' in cpu and cpu.endswith("--enforce-eager")
    assert (
        "vllm serve o/t" in cmds["vLLM"] and "--speculative-num-draft-tokens 16" in cmds["SGLang"]
    )
