"""The GGUF cache: a part read back from its plain files is the part the GGUF gave, and a cache
that is off, unwritable, damaged, stale or written by two processes at once never changes what a
load returns."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from dflash_trainer import gguf_cache
from dflash_trainer.assets import AssetNotFound, asset_path
from dflash_trainer.data.tokenizer_check import serialized_sha256

TEXTS = [
    "Hello world! How are you today?",
    "def f(x):\n    return x ** 2  # é 漢字 🙂",
    "  several   spaces\n\n\ttabs and <|im_start|>inline specials<|im_end|>",
]


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    root = tmp_path / "cache"
    monkeypatch.setenv(gguf_cache.ENV, str(root))
    return root


@pytest.fixture
def smollm2() -> tuple[str, str]:
    try:
        path = asset_path("smollm2-135m-instruct")
    except AssetNotFound as e:
        pytest.skip(str(e))
    return str(path.parent), path.name


def refuse_gguf(monkeypatch) -> None:
    """From here on, any parse of a GGUF by transformers fails the test: a load must come from
    the cache's plain files."""
    import transformers

    for cls in ("AutoConfig", "AutoTokenizer", "AutoModelForCausalLM"):
        auto = getattr(transformers, cls)
        real = auto.from_pretrained.__func__

        def guarded(klass, *args, _real=real, _cls=cls, **kwargs):
            assert "gguf_file" not in kwargs, f"{_cls} parsed the GGUF although it is cached"
            return _real(klass, *args, **kwargs)

        monkeypatch.setattr(auto, "from_pretrained", classmethod(guarded))


@pytest.mark.slow
def test_config_and_tokenizer_from_the_cache_are_the_gguf_s(smollm2, monkeypatch):
    """On the session's cache: built here, or by whichever test loaded the asset first."""
    from transformers import AutoConfig, AutoTokenizer

    cfg = AutoConfig.from_pretrained(smollm2[0], gguf_file=smollm2[1])
    tok = AutoTokenizer.from_pretrained(smollm2[0], gguf_file=smollm2[1])
    gguf_cache.config(*smollm2), gguf_cache.tokenizer(*smollm2)
    refuse_gguf(monkeypatch)
    cfg2, tok2 = gguf_cache.config(*smollm2), gguf_cache.tokenizer(*smollm2)
    assert cfg.to_dict() == cfg2.to_dict()  # the name too: prepared data records it
    assert tok.name_or_path == tok2.name_or_path
    assert serialized_sha256(tok) == serialized_sha256(tok2)
    assert [tok(t).input_ids for t in TEXTS] == [tok2(t).input_ids for t in TEXTS]
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    assert tok.apply_chat_template(msgs, tokenize=False) == tok2.apply_chat_template(
        msgs, tokenize=False
    )
    assert (tok.eos_token, tok.pad_token, tok.bos_token, len(tok)) == (
        tok2.eos_token,
        tok2.pad_token,
        tok2.bos_token,
        len(tok2),
    )


@pytest.mark.slow
def test_weights_from_the_cache_in_any_dtype_are_the_dequantised_gguf(smollm2, monkeypatch):
    from transformers import AutoModelForCausalLM, GgufConfig

    direct = AutoModelForCausalLM.from_pretrained(
        smollm2[0],
        gguf_file=smollm2[1],
        dtype=torch.float32,
        quantization_config=GgufConfig(dequantize=True),
    )
    gguf_cache.causal_lm(*smollm2, torch.float32)  # builds the part unless a test did before
    refuse_gguf(monkeypatch)
    fp32 = gguf_cache.causal_lm(*smollm2, torch.float32)
    bf16 = gguf_cache.causal_lm(*smollm2, torch.bfloat16)
    assert not getattr(fp32, "is_quantized", False)  # plain tensors, savable (vLLM's copy)
    assert fp32.name_or_path == bf16.config.name_or_path == direct.name_or_path
    ref, got, half = direct.state_dict(), fp32.state_dict(), bf16.state_dict()
    assert ref.keys() == got.keys() == half.keys()
    for k in ref:
        assert torch.equal(ref[k], got[k]), k
        assert torch.equal(ref[k].to(torch.bfloat16), half[k]), k
    ids = torch.tensor([[1, 22, 333, 4444]])
    assert torch.equal(direct(ids).logits, fp32(ids).logits)


# The cache's own behaviour, on real HF configs: each build costs a config, not a GGUF parse.


def tiny_config(hidden: int = 64):
    from transformers import LlamaConfig

    return LlamaConfig(hidden_size=hidden, num_hidden_layers=1, vocab_size=50)


def load(gguf: Path, built: list[int] | None = None, hidden: int = 64):
    from transformers import AutoConfig

    def from_gguf():
        if built is not None:
            built.append(1)
        return tiny_config(hidden)

    return gguf_cache.cached(
        str(gguf.parent),
        gguf.name,
        "config",
        from_gguf,
        lambda p: AutoConfig.from_pretrained(p),
        lambda c, p: c.save_pretrained(p),
    )


@pytest.fixture
def gguf(tmp_path) -> Path:
    path = tmp_path / "model.gguf"
    path.write_bytes(b"GGUF" + os.urandom(3 << 20))
    return path


def test_a_part_is_built_once_then_read(cache, gguf):
    built: list[int] = []
    assert load(gguf, built).hidden_size == 64
    assert load(gguf, built).hidden_size == 64
    assert built == [1]
    entry = next((cache / "gguf").iterdir())
    # No temporary directory left; the part's lock file stays (empty: a lock, not a record).
    assert sorted(p.name for p in entry.iterdir()) == [".config.lock", "config"]
    assert (entry / ".config.lock").stat().st_size == 0


def test_off_and_unwritable_caches_load_directly(cache, gguf, monkeypatch):
    monkeypatch.setenv(gguf_cache.ENV, "off")
    built: list[int] = []
    load(gguf, built), load(gguf, built)
    assert built == [1, 1] and not cache.exists()
    blocker = gguf.parent / "a-file"
    blocker.write_text("")
    monkeypatch.setenv(gguf_cache.ENV, str(blocker))  # a file where the directory would go
    assert load(gguf, built).hidden_size == 64
    assert blocker.read_text() == ""
    # A cache path the system cannot even look at (here: a name over the length limit).
    monkeypatch.setenv(gguf_cache.ENV, str(gguf.parent / ("x" * 300)))
    assert load(gguf, built).hidden_size == 64


def test_a_changed_file_gets_a_new_entry(cache, gguf):
    built: list[int] = []
    load(gguf, built)
    with gguf.open("r+b") as f:  # the same size, one byte different in the header
        f.seek(5)
        f.write(b"\x00" if f.read(1) != b"\x00" else b"\x01")
    assert load(gguf, built, hidden=32).hidden_size == 32
    assert built == [1, 1] and len(list((cache / "gguf").iterdir())) == 2


@pytest.mark.parametrize("damage", ["cut", "fifo", "huge"])
def test_a_damaged_part_is_rebuilt_and_said(cache, gguf, capsys, damage):
    load(gguf)
    config = next((cache / "gguf").iterdir()) / "config" / "config.json"
    if damage == "cut":
        config.write_text('{"model_type": ')
    elif damage == "fifo":  # read, it would block
        config.unlink()
        os.mkfifo(config)
    else:  # loads, but no real model is this size: read, it would allocate for ever
        config.write_text(json.dumps({**json.loads(config.read_text()), "hidden_size": 1 << 30}))
    built: list[int] = []
    assert load(gguf, built).hidden_size == 64
    assert built == [1]
    assert "does not load" in capsys.readouterr().err
    assert load(gguf, built).hidden_size == 64 and built == [1]  # the rebuilt part serves


def test_two_processes_loading_one_part_parse_the_gguf_once(cache, gguf, tmp_path):
    """The second waits for the first's build (the part's lock) and reads what it wrote; a
    third, killed while it builds, leaves neither a held lock nor a half part."""
    script = textwrap.dedent(
        f"""
        import sys, time
        from pathlib import Path
        from transformers import AutoConfig, LlamaConfig
        from dflash_trainer import gguf_cache
        gate = Path({str(tmp_path / "go")!r})
        while not gate.exists():
            time.sleep(0.01)
        def slow():
            print("parsed", flush=True)
            time.sleep(float(sys.argv[1]))  # the other process asks meanwhile
            return LlamaConfig(hidden_size=64, num_hidden_layers=1, vocab_size=50)
        cfg = gguf_cache.cached({str(gguf.parent)!r}, {gguf.name!r}, "config", slow,
                                AutoConfig.from_pretrained, lambda c, p: c.save_pretrained(p))
        print(cfg.hidden_size)
        """
    )
    env = {**os.environ, gguf_cache.ENV: str(cache)}

    def start(seconds: float) -> subprocess.Popen[str]:
        argv = [sys.executable, "-c", script, str(seconds)]
        return subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, text=True)

    (tmp_path / "go").touch()
    stuck = start(600.0)  # parses, then is killed while it holds the lock
    assert stuck.stdout is not None and stuck.stdout.readline().strip() == "parsed"
    stuck.kill()
    stuck.wait()
    procs = [start(1.0) for _ in range(2)]
    outs = [p.communicate(timeout=120)[0].split() for p in procs]
    assert [p.returncode for p in procs] == [0, 0]
    assert sorted(outs) == [["64"], ["parsed", "64"]]  # one parse for the two
    entry = next((cache / "gguf").iterdir())
    assert sorted(p.name for p in entry.iterdir()) == [".config.lock", "config"]
    assert load(gguf).hidden_size == 64
