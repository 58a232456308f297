"""Config: defaults < TOML < CLI, and every kind of bad input fails with exit code 2 and one message."""

from __future__ import annotations

import dataclasses
import re
import subprocess
import sys
from pathlib import Path

import pytest

from titanium.config import ConfigError, JobConfig, load_config
from titanium.config.components import OBJECTIVES
from titanium.config.registry import SectionSpec
from titanium.config.sections import RLSection, RolloutSection
from titanium.objectives import build_objective

REPO = Path(__file__).resolve().parents[2]


def write(tmp_path: Path, text: str) -> str:
    path = tmp_path / "job.toml"
    path.write_text(text)
    return str(path)


def test_defaults_then_toml_then_cli(tmp_path, monkeypatch):
    monkeypatch.chdir(REPO)
    path = write(tmp_path, "[training]\nsteps = 7\nseq_len = 64\n[optimizer]\nlr = 1\n")
    cfg = load_config(["--job.config_file", path, "--training.steps", "9"])
    assert cfg.training.steps == 9  # CLI beats TOML
    assert cfg.training.seq_len == 64  # TOML beats default
    assert cfg.training.local_batch_size == JobConfig().training.local_batch_size  # default kept
    assert cfg.optimizer.lr == 1.0 and isinstance(cfg.optimizer.lr, float)  # TOML int widened to float
    assert cfg.job.config_file == path


def test_cli_accepts_equals_and_hyphens(monkeypatch):
    monkeypatch.chdir(REPO)
    cfg = load_config(["--training.seq-len=32", "--checkpoint.enable", "--lr_scheduler.decay_ratio", "0.5"])
    assert cfg.training.seq_len == 32 and cfg.checkpoint.enable and cfg.lr_scheduler.decay_ratio == 0.5


@pytest.mark.parametrize(
    "toml, message",
    [
        ("[trainig]\nsteps = 1\n", "unknown section [trainig]; did you mean 'training'?"),
        ("[training]\nstep = 1\n", "unknown key 'step' in [training]; did you mean 'steps'?"),
        ('[training]\nsteps = "ten"\n', "[training] steps = 'ten': expected an integer"),
        ("[training]\nsteps = 1.5\n", "expected an integer"),
        ("[checkpoint]\nenable = 1\n", "expected true or false"),
        ('[lr_scheduler]\ndecay_type = "cosin"\n', "expected one of 'linear', 'cosine', 'sqrt'"),
        ("[training]\nsteps = -1\n", "--training.steps must be >= 0 (0: evaluate only, no training), got -1"),
        ("[lr_scheduler]\ndecay_ratio = 1.5\n", "decay_ratio must be in (0, 1]"),
        ('[tokenizer]\npath = "nope.tiktoken"\n', "--tokenizer.path: file not found: nope.tiktoken"),
        ('[data]\npath = "missing/*.jsonl"\n', "--data.path: no file matches missing/*.jsonl"),
        ("[training\nsteps = 1\n", "not valid TOML"),
        ("training = 3\n", "must be a [section] table"),
    ],
)
def test_bad_toml_is_reported(tmp_path, monkeypatch, toml, message):
    monkeypatch.chdir(REPO)
    with pytest.raises(ConfigError) as err:
        load_config(["--job.config_file", write(tmp_path, toml)])
    assert message in str(err.value)


def test_missing_config_file(monkeypatch):
    monkeypatch.chdir(REPO)
    with pytest.raises(ConfigError, match="config file not found: nope.toml"):
        load_config(["--job.config_file", "nope.toml"])


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "titanium.train", *args], cwd=REPO, capture_output=True, text=True, timeout=120
    )


@pytest.mark.parametrize(
    "args, message",
    [
        (["--job.config_file", "nope.toml"], "config file not found"),
        (["--training.steps", "-3"], "--training.steps must be >= 0"),
        (["--training.stepz", "3"], "--training.steps"),  # tyro's did-you-mean
        (["--training.steps", "x"], "--training.steps"),
        (["--parallelism.data_parallel_shard_degree", "3"], "world size is 1"),
    ],
)
def test_cli_errors_exit_2_without_traceback(args, message):
    result = run_cli(*args)
    assert result.returncode == 2, result.stderr
    assert message in result.stderr
    assert "Traceback" not in result.stderr


def test_help_lists_every_option_with_default():
    result = run_cli("--help")
    assert result.returncode == 0
    text = " ".join(result.stdout.split()).replace("│ ", "").replace(" │", "")
    for section in dataclasses.fields(JobConfig):
        for f in dataclasses.fields(getattr(JobConfig(), section.name)):
            assert f"--{section.name}.{f.name}" in text, f"--{section.name}.{f.name} missing from --help"
    assert "(default: 1000)" in text


def test_every_field_has_a_docstring_and_the_reference_is_current():
    from titanium.config.reference import field_docs, render_reference

    for section in dataclasses.fields(JobConfig):
        obj = getattr(JobConfig(), section.name)
        documented = field_docs(type(obj))
        for f in dataclasses.fields(obj):
            assert documented.get(f.name), f"[{section.name}] {f.name} has no docstring"
    on_disk = (REPO / "docs/configuration.md").read_text()
    assert on_disk == render_reference(), "docs/configuration.md is stale: run python scripts/gen_config_docs.py"


@pytest.mark.parametrize("path", sorted((REPO / "train_configs").glob("*.toml")), ids=lambda p: p.name)
def test_shipped_configs_parse(path, monkeypatch, tmp_path):
    monkeypatch.chdir(REPO)
    # The big configs name files users download (tokenizer, weights to start from) or an earlier run's
    # checkpoint; stand-ins take their place. Everything else must parse as shipped.
    args = ["--job.config_file", str(path), "--tokenizer.path", "assets/tokenizer/titanium_debug.tiktoken"]
    if "initial_load_path" in path.read_text():
        (tmp_path / "config.json").write_text("{}")
        args += ["--checkpoint.initial_load_path", str(tmp_path)]
    cfg = load_config(args)
    assert cfg.training.steps >= 1


def test_an_objective_given_by_import_path_brings_its_section(tmp_path, monkeypatch):
    monkeypatch.chdir(REPO)
    objective = "tests.objectives.reference:ReferenceObjective"
    path = write(tmp_path, f'[training]\nobjective = "{objective}"\n[reference]\npenalty = 2\n')
    assert load_config(["--job.config_file", path]).reference.penalty == 2.0  # from the TOML file
    cfg = load_config(["--training.objective", objective, "--reference.penalty", "3"])
    assert cfg.reference.penalty == 3.0  # from the command line
    with pytest.raises(ConfigError, match=r"unknown section \[reference\]"):
        load_config(["--job.config_file", write(tmp_path, "[reference]\npenalty = 2\n")])  # another objective
    with pytest.raises(ConfigError, match="cannot import tests.objectives.reference:Nope"):
        load_config(["--training.objective", "tests.objectives.reference:Nope"])


@dataclasses.dataclass
class _LevelSection:
    level: int = 1
    """A test section."""


class _ReadsMoreSections:
    """An objective of one's own (by import path) that reads GRPO's [rollout] and a section of its own."""

    more_sections = (SectionSpec("rollout", RolloutSection), SectionSpec("level_test", _LevelSection))

    def __init__(self, ctx, data, section, **more) -> None:
        self.section, self.more = section, more


def test_further_sections_reach_their_objective_by_keyword(monkeypatch):
    """[rl] and [rollout] belong to GRPO's registry entry (the loop never names them), and an objective by import
    path declares the further sections it reads the same way; each arrives by keyword, with its CLI values."""
    monkeypatch.chdir(REPO)
    assert OBJECTIVES.more_sections("grpo") == (SectionSpec("rl", RLSection), SectionSpec("rollout", RolloutSection))
    assert ".rollout" not in (REPO / "titanium" / "trainer.py").read_text()
    objective = f"{__name__}:_ReadsMoreSections"
    cfg = load_config(["--training.objective", objective, "--rollout.engine", "vllm", "--level_test.level", "3"])
    built = build_objective(objective, None, cfg.data, cfg)
    assert built.section is None
    assert built.more["rollout"].engine == "vllm" and built.more["level_test"].level == 3


def test_chat_settings_moved_from_sft_still_read_with_a_warning(tmp_path, monkeypatch, caplog):
    monkeypatch.chdir(REPO)
    path = write(tmp_path, '[sft]\nchat_template = "chatml"\npacking = false\n')
    cfg = load_config(["--job.config_file", path, "--sft.system_prompt", "Be brief."])
    assert (cfg.chat.chat_template, cfg.chat.system_prompt, cfg.sft.packing) == ("chatml", "Be brief.", False)
    assert "[sft] chat_template is deprecated" in caplog.text and "use [chat] chat_template" in caplog.text
    assert "--sft.system_prompt is deprecated" in caplog.text and "use --chat.system_prompt" in caplog.text
    with pytest.raises(ConfigError, match=r"\[sft\] chat_template and \[chat\] chat_template are the same setting"):
        load_config(["--job.config_file", write(tmp_path, '[sft]\nchat_template = "a"\n[chat]\nchat_template = "b"\n')])
    with pytest.raises(ConfigError, match="--sft.chat_template and --chat.chat_template are the same setting"):
        load_config(["--sft.chat_template", "llama3", "--chat.chat_template", "llama3"])


def test_grpo_and_ppo_sampling_and_reward_keys_moved_to_rl_still_read_with_a_warning(tmp_path, monkeypatch, caplog):
    """GRPO's and PPO's shared keys are [rl]'s now; PPO's reward_model_path is the first of [rl] rewards (weight 1,
    before the rule rewards' weights), as both objectives name reward models since they share a rollout source."""
    monkeypatch.chdir(REPO)
    path = write(tmp_path, '[grpo]\ngroup_size = 4\ntemperature = 0.7\nrewards = ["format"]\n')
    cfg = load_config(["--job.config_file", path, "--grpo.max_new_tokens", "16", "--ppo.top_k", "5"])
    assert (cfg.grpo.group_size, cfg.rl.temperature, cfg.rl.rewards) == (4, 0.7, ["format"])
    assert (cfg.rl.max_new_tokens, cfg.rl.top_k) == (16, 5)
    assert "[grpo] temperature is deprecated" in caplog.text and "use [rl] temperature" in caplog.text
    assert "--ppo.top_k is deprecated" in caplog.text and "use --rl.top_k" in caplog.text
    ppo = write(tmp_path, '[ppo]\nreward_model_path = "rm"\nrewards = ["exact_match"]\nreward_weights = [3.0]\n')
    cfg = load_config(["--job.config_file", ppo])
    assert (cfg.rl.rewards, cfg.rl.reward_weights) == (["rm", "exact_match"], [1.0, 3.0])
    cfg = load_config(["--ppo.reward_model_path", "rm"])  # (no rule rewards given: the reward model alone)
    assert (cfg.rl.rewards, cfg.rl.reward_weights) == (["rm"], [])
    with_rules = write(tmp_path, '[rl]\nrewards = ["exact_match"]\nreward_weights = [3.0]\n')
    cfg = load_config(["--job.config_file", with_rules, "--ppo.reward_model_path", "rm"])
    assert (cfg.rl.rewards, cfg.rl.reward_weights) == (["rm", "exact_match"], [1.0, 3.0])
    with pytest.raises(ConfigError, match="--grpo.temperature and --rl.temperature are the same setting"):
        load_config(["--grpo.temperature", "0.5", "--rl.temperature", "0.5"])


@pytest.mark.parametrize(
    "flag, hint",
    [
        (["--learning_rate", "1e-4"], "--learning_rate is TRL's name; titanium's is --optimizer.lr"),
        (["--per-device-train-batch-size=8"], "titanium's is --training.local_batch_size"),
        (["--num_train_epochs", "3"], "--training.steps (titanium counts optimizer steps, not epochs)"),
        (["--max_length", "512"], "titanium's is --training.seq_len"),
        (["--beta", "0.1"], "titanium's is --dpo.beta (DPO) or --grpo.beta (GRPO)"),
        (["--use_peft"], "titanium's is --lora.rank R (a rank above 0 turns LoRA on)"),
        (["--lora_r", "8"], "titanium's is --lora.rank (python -m titanium.train --help lists every option)"),
        (["--lora_target_modules", "q_proj", "v_proj"], "--lora.target_modules (PEFT's names are accepted"),
    ],
)
def test_a_trl_option_name_gets_titaniums(flag, hint):
    """It used to be the CLI parser's "Unrecognized options"; each TRL name maps to an option that exists."""
    with pytest.raises(ConfigError, match=re.escape(hint)):
        load_config(flag)


def test_every_trl_name_maps_to_an_existing_option():
    from titanium.config.trl_names import TRL_NAMES

    cfg = load_config([])
    for name, target in TRL_NAMES.items():
        for option in re.findall(r"--(\w+)\.(\w+)", target):
            assert hasattr(getattr(cfg, option[0]), option[1]), (name, option)


def test_unknown_options_point_at_help_as_users_type_it(capsys):
    with pytest.raises(SystemExit):
        load_config(["--training.stepz", "3"])
    assert "python -m titanium.train --help" in capsys.readouterr().err.replace("\n", " ")
