"""The kd objective's bad input: ranges at config time, the teacher when it is read (exit code 2)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from tests.helpers import REPO, env
from titanium.checkpoint.hf import export_hf
from titanium.config import load_config
from titanium.config.loader import ConfigError
from titanium.config.sections import KDSection
from titanium.model_builder import ModelBuilder
from titanium.models import build_model_args, get_model_spec
from titanium.objectives.kd import teacher_source

KD = ["--training.objective", "kd", "--data.kind", "chat", "--kd.teacher_path", "somewhere"]


@pytest.mark.parametrize(
    "args, message",
    [
        ([*KD, "--kd.alpha", "1.5"], r"--kd.alpha must be in \[0, 1\]"),
        ([*KD, "--kd.temperature", "0"], "--kd.temperature must be > 0"),
        ([*KD, "--kd.beta", "-0.1"], r"--kd.beta must be in \[0, 1\]"),
        (["--training.objective", "kd", "--data.kind", "chat"], "--kd.teacher_path is required"),
    ],
)
def test_bad_kd_configs_are_refused(args, message):
    with pytest.raises(ConfigError, match=message):
        load_config(args)


@pytest.fixture(scope="module")
def hf_teacher(tmp_path_factory):
    """A debug-model teacher in HF format with a vocabulary of 1000 (the debug tokenizer has 2256)."""
    spec = get_model_spec("llama3")
    args = build_model_args(spec, "debugmodel", max_seq_len=64, vocab_size=1000)
    folder = tmp_path_factory.mktemp("teacher") / "hf"
    export_hf(ModelBuilder(torch.device("cpu")).build(spec, args).model, folder, spec.hf_adapter, args)
    return folder


def test_a_teacher_is_read_with_its_shape_or_refused(hf_teacher, tmp_path):
    source = teacher_source(KDSection(teacher_path=str(hf_teacher)), "llama3", 1000, 64)
    assert source.args.vocab_size == 1000 and source.weights.hf_folder == str(hf_teacher)
    with pytest.raises(ConfigError, match="the teacher's vocabulary has 1000 entries, the student's 2256"):
        teacher_source(KDSection(teacher_path=str(hf_teacher)), "llama3", 2256, 64)
    with pytest.raises(ConfigError, match="give its shape with --kd.teacher_flavor"):
        teacher_source(KDSection(teacher_path=str(tmp_path)), "llama3", 2256, 64)
    with pytest.raises(ConfigError, match="no such folder"):
        teacher_source(KDSection(teacher_path=str(tmp_path / "nope")), "llama3", 2256, 64)


def test_a_teacher_with_another_vocabulary_exits_2(hf_teacher, tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "titanium.train", "--job.config_file", "train_configs/debug_kd.toml",
         "--job.dump_folder", str(tmp_path), "--kd.teacher_path", str(hf_teacher), "--training.steps", "1",
         "--checkpoint.initial_load_path", "", "--checkpoint.no_enable", "--eval.interval", "0"],
        cwd=REPO, env=env(), capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 2, result.stderr[-2000:]
    assert "the teacher's vocabulary has 1000 entries, the student's 2256" in result.stderr
    assert "Traceback" not in result.stderr
