"""Credentials in run.storage_options never reach config.yaml or run_info.json in clear."""

from __future__ import annotations

import json

from dflash_trainer.config import load_config
from dflash_trainer.redact import looks_secret, redact_argv
from dflash_trainer.train.run_dir import write_run_files

KEY = "AKIAIOSFODNN7EXAMPLE"
SECRET = "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY"
TOKEN = "hf_AbCdEfGhIjKlMnOpQrStUvWxYz012345"


def test_run_files_leave_credentials_out_and_say_where_they_go(tmp_path):
    overrides = [
        f"run.output_dir={tmp_path / 'run'}",
        f"run.storage_options={{key: {KEY}, secret: '{SECRET}', "
        "endpoint_url: 'https://s3.example.com', client_kwargs: {region_name: eu-west-1}}",
        f"--set=run.storage_options.session_token={TOKEN}",
        f"run.storage_options.opaque={TOKEN[3:]}",  # no telling name: the value's shape says it
    ]
    cfg = load_config(recipe="qwen3-8b", overrides=[o.removeprefix("--set=") for o in overrides])
    run = tmp_path / "run"
    write_run_files(run, cfg, ["dflash", "train", "--recipe", "qwen3-8b", *overrides])
    written = (run / "config.yaml").read_text() + (run / "run_info.json").read_text()
    for secret in (KEY, SECRET, TOKEN, TOKEN[3:]):
        assert secret not in written
    assert "<redacted>" in (run / "run_info.json").read_text()
    assert "AWS_SECRET_ACCESS_KEY" in (run / "config.yaml").read_text().splitlines()[0]
    info = json.loads((run / "run_info.json").read_text())
    assert sorted(info["redacted"]["run.storage_options"]) == [
        "key", "opaque", "secret", "session_token"
    ]  # fmt: skip
    # The written config still loads (resume reads it), without the credentials.
    again = load_config(config_file=str(run / "config.yaml"))
    assert again.run.storage_options == {
        "endpoint_url": "https://s3.example.com",
        "client_kwargs": {"region_name": "eu-west-1"},
    }


def test_plain_options_are_kept():
    for name, value in [
        ("endpoint_url", "https://s3.example.com/bucket"),
        ("anon", True),
        ("region_name", "us-east-1"),
        ("use_ssl", False),
        ("default_block_size", 5242880),
    ]:
        assert not looks_secret(name, value)
    assert redact_argv(["run.storage_options.anon=true"]) == ["run.storage_options.anon=true"]
    assert redact_argv(["run.storage_options.password=x"]) == [
        "run.storage_options.password=<redacted>"
    ]


def test_credentials_inside_lists_and_longer_values_are_left_out():
    """Found by a hostile round: a list of headers, a list of client options, a connection
    string, a URL's password, `pwd`, and `--set=` before the override all reached config.yaml
    or run_info.json in clear."""
    from dflash_trainer.redact import redact_config

    options = {
        "headers": ["Authorization: Bearer LEAK1"],
        "client_kwargs": [{"token": "LEAK2"}],
        "connection_string": "DefaultEndpointsProtocol=https;AccountName=a;AccountKey=LEAK3==",
        "endpoint_url": "https://user:LEAK4@example.invalid",
        "pwd": "LEAK5",
        "credentials": {"type": "service_account", "client_email": "LEAK6@x"},
        "region_name": "eu-west-1",
        "anon": False,
    }
    kept, dropped = redact_config({"run": {"storage_options": options}})
    assert "LEAK" not in json.dumps(kept)
    assert kept["run"]["storage_options"]["region_name"] == "eu-west-1"
    assert "credentials" in dropped and "client_kwargs[0].token" in dropped
    words = ["--set=run.storage_options.pwd=hunter2", "run.storage_options.client_kwargs=[{token: x}]",
             'run.storage_options.headers=["Bearer abc"]', "run.storage_options={a: [{secret: y}]}"]  # fmt: skip
    masked = " ".join(redact_argv(words))
    assert not any(s in masked for s in ("hunter2", "token: x", "abc", "secret: y")), masked
