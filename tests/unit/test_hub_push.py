"""Uploads to the Hugging Face hub ([checkpoint] push_to_hub, tools.convert --push-to-hub) without the network:
``huggingface_hub.HfApi`` is replaced by a recorder. The repository id and the token (from HF_TOKEN) are checked
before any work; a missing or bad one is one message and exit code 2."""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
from pathlib import Path

import huggingface_hub
import pytest

from tests.helpers import tiny_args
from titanium.checkpoint.hf import save_hf_weights
from titanium.config import ConfigError, load_config
from titanium.models.llama3 import LLAMA3_FLAVORS, Transformer
from titanium.models.llama3.hf import LLAMA3_HF_ADAPTER
from titanium.preflight import main as preflight
from titanium.tools.convert import main as convert

TOKEN = "hf_test_token_from_the_environment"


class RecordingApi:
    """What the upload asked of the hub API, with the token huggingface_hub resolved at that moment."""

    calls: list[tuple] = []
    fail: BaseException | None = None

    def create_repo(self, repo_id: str, *, private: bool, exist_ok: bool) -> str:
        self.calls.append(("create_repo", repo_id, private, exist_ok, huggingface_hub.get_token()))
        return f"https://huggingface.co/{repo_id}"

    def upload_folder(self, *, folder_path: str, repo_id: str, commit_message: str) -> None:
        if self.fail is not None:
            raise self.fail
        files = sorted(p.name for p in Path(folder_path).iterdir())
        self.calls.append(("upload_folder", repo_id, folder_path, files))


@pytest.fixture
def hub(monkeypatch, tmp_path: Path) -> type[RecordingApi]:
    monkeypatch.setattr(huggingface_hub, "HfApi", RecordingApi)
    monkeypatch.setattr(RecordingApi, "calls", [])
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf_home"))  # (no stored login token)
    monkeypatch.delenv("HF_TOKEN_PATH", raising=False)
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    return RecordingApi


def _hf_folder(folder: Path) -> Path:
    args = dataclasses.replace(LLAMA3_FLAVORS["debugmodel"], n_layers=1, dim=32, n_heads=2, n_kv_heads=1, vocab_size=64)
    model = Transformer(args)
    model.init_weights()
    return save_hf_weights(model.state_dict(), folder, LLAMA3_HF_ADAPTER, args)


def test_convert_pushes_the_folder_it_wrote(hub, tmp_path: Path, capsys) -> None:
    source = _hf_folder(tmp_path / "source")
    assert convert(["from-hf", str(source), str(tmp_path / "ckpt"), "--model", "llama3"]) == 0
    out = tmp_path / "out"
    argv = ["to-hf", str(tmp_path / "ckpt/step-0"), str(out), "--model", "llama3", "--source", str(source)]
    assert convert([*argv, "--push-to-hub", "me/tiny-llama"]) == 0
    assert hub.calls == [
        ("create_repo", "me/tiny-llama", True, True, TOKEN),
        ("upload_folder", "me/tiny-llama", str(out), ["config.json", "model.safetensors"]),
    ]
    assert "uploaded to https://huggingface.co/me/tiny-llama" in capsys.readouterr().out

    for failure in NETWORK_FAILURES:  # (the folder was written: the message says where, and how to upload it)
        hub.fail = failure
        try:
            assert convert([*argv, "--push-to-hub", "me/tiny-llama"]) == 2
        finally:
            hub.fail = None
        err = capsys.readouterr().err
        assert str(failure) in err and "Traceback" not in err and len(err.strip().splitlines()) == 1, err
        assert f"the export is complete in {out.resolve()}; upload it later with `hf upload me/tiny-llama {out}`" in err


def _network_failures() -> list[BaseException]:
    """A refused connection, and what huggingface_hub's own HTTP client raises without a network (httpx2 in
    huggingface_hub 2.x, httpx in 1.x: not OSErrors)."""
    failures: list[BaseException] = [OSError("connection refused")]
    for module in ("httpx2", "httpx"):
        if importlib.util.find_spec(module) is not None:
            failures.append(importlib.import_module(module).ConnectError("[Errno -2] Name or service not known"))
    return failures


NETWORK_FAILURES = _network_failures()


@pytest.mark.parametrize(
    ("repo", "token", "message"),
    [
        ("me/tiny", None, "--push-to-hub me/tiny: no Hugging Face token; set HF_TOKEN"),
        ("tiny", TOKEN, "--push-to-hub 'tiny' is not a Hugging Face repository id: expected namespace/name"),
        ("me/bad name", TOKEN, "--push-to-hub 'me/bad name' is not a Hugging Face repository id"),
    ],
)
def test_missing_token_or_bad_repo_fails_before_any_work(hub, monkeypatch, tmp_path, capsys, repo, token, message):
    if token is None:
        monkeypatch.delenv("HF_TOKEN")
    argv = ["to-peft", str(tmp_path / "run/checkpoint/step-1"), str(tmp_path / "adapter"), "--push-to-hub", repo]
    assert convert(argv) == 2
    err = capsys.readouterr().err  # (not the missing checkpoint: the upload is checked first)
    assert message in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert hub.calls == []


def test_training_pushes_its_hf_export(hub, make_trainer, monkeypatch, tmp_path: Path, capsys) -> None:
    push = ("--training.steps", "1", "--checkpoint.last_save_in_hf", "--checkpoint.push_to_hub", "me/run")
    with pytest.raises(ConfigError, match="push_to_hub me/run: uploads the Hugging Face export; set --checkpoint"):
        load_config(tiny_args(tmp_path / "run", *push[:2], *push[3:]))
    monkeypatch.delenv("HF_TOKEN")  # checked before the run (titanium.train and run_train.sh run the preflight)
    assert preflight(tiny_args(tmp_path / "run", *push)) == 2
    assert "--checkpoint.push_to_hub me/run: no Hugging Face token" in capsys.readouterr().err
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    assert preflight(tiny_args(tmp_path / "run", *push)) == 0

    make_trainer(*tiny_args(tmp_path / "run", *push)).train()
    assert hub.calls == [
        ("create_repo", "me/run", True, True, TOKEN),
        (
            "upload_folder",
            "me/run",
            str(tmp_path / "run/hf"),
            [
                "chat_template.jinja",  # (the run's tokenizer and chat format go with every export)
                "config.json",
                "model.safetensors",
                "tokenizer.json",
                "tokenizer_config.json",
            ],
        ),
    ]


def test_a_training_push_without_network_says_where_the_export_is(hub, tmp_path: Path, capsys) -> None:
    """The upload at the end of a run fails (no network: huggingface_hub's HTTP client error): the run has trained and
    exported, so it ends with one message saying where the export is and the command that uploads it later, exit 2."""
    from titanium.train import main

    hub.fail = NETWORK_FAILURES[-1]
    try:
        push = ("--training.steps", "1", "--checkpoint.last_save_in_hf", "--checkpoint.push_to_hub", "me/run")
        assert main(tiny_args(tmp_path / "run", *push)) == 2
    finally:
        hub.fail = None
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("titanium: error: uploading") and "Traceback" not in err, err
    assert f"the export is complete in {tmp_path / 'run/hf'}; upload it later with `hf upload me/run" in lines[0], err
    assert (tmp_path / "run/hf/model.safetensors").is_file()
