"""Optional extras, skipped where not installed: an OpenEnv environment run unchanged as a titanium environment
(``openenv-core``), and the ``math_verify`` reward equal to TRL's ``accuracy_reward`` (``math-verify``)."""

from __future__ import annotations

import pytest

from tests.objectives.scripted_engine import ScriptedEngine
from tests.unit.test_episodes import EOT, TEMPLATE, TOKENIZER, encode, sample
from titanium.config.errors import ConfigError
from titanium.config.sections import EnvironmentSection
from titanium.generation.sampling import SamplingParams
from titanium.rl.env.registry import environment_spec
from titanium.rl.episodes import EpisodeRunner
from titanium.rl.rewards.functions import RewardSet


def test_an_openenv_environment_plays_episodes() -> None:
    pytest.importorskip("openenv", reason="pip install openenv-core")
    cfg = EnvironmentSection(name="openenv:tests.objectives.openenv_countdown:Countdown", args='{"start": 3}')
    spec = environment_spec(cfg)
    assert spec is not None and spec.reward_terms == ("openenv",)
    runner = EpisodeRunner(spec, cfg, TEMPLATE, TOKENIZER, 120, max_prompt_len=64)
    answers = {"right": ["3", "2", "1"], "wrong": ["3", "5"]}

    def respond(ids: list[int]) -> list[int]:  # (the opening observation is in the prompt; one answer per turn)
        text = TOKENIZER.decode(ids)
        assert "Count down from 3." in text
        script = answers["wrong" if "wrongly" in text else "right"]
        return encode(script[text.count("<|start_header_id|>assistant") - 1]) + [EOT]

    engine = ScriptedEngine(respond, TEMPLATE.stop_ids, TOKENIZER.pad_id)
    samples = [sample("Play, please.", "1"), sample("Play wrongly, please.", "1")]
    episodes, _ = runner.run(engine, samples, SamplingParams(120, 1.0), seed=0)
    out = runner.rollout(episodes, RewardSet(["exact_match"]))
    runner.close()
    assert out.stats["turns"].tolist() == [3, 2] and out.completions == ["1", "5"]
    assert out.rewards.per_function["openenv"].tolist() == [3.0, 1.0]
    assert out.rewards.total.tolist() == [4.0, 1.0]  # (exact match of "1", plus the environment's rewards)
    assert "Now 2." in out.transcripts[0] and "Now 1." in out.transcripts[0]
    with pytest.raises(ConfigError, match="not an OpenEnv Environment"):
        environment_spec(EnvironmentSection(name="openenv:tests.objectives.tools:add"))


def test_verifiers_environments_are_refused_with_the_reason() -> None:
    with pytest.raises(ConfigError, match="not supported yet"):
        environment_spec(EnvironmentSection(name="verifiers:gsm8k"))


CASES = [
    (r"My answer is \boxed{\frac{1}{3}}", r"\frac{1}{3}"),
    (r"So \boxed{0.3333}", r"\frac{1}{3}"),
    (r"$x = 2$", "2"),
    (r"The set is $\{1, 2\}$", r"\{2, 1\}"),
    (r"I think 3, no 2", "2"),
    (r"\boxed{5 \text{ cm}}", "5"),
    ("no math here", "7"),
    (r"\boxed{1}", "not math"),
]


def test_math_verify_scores_as_trls_accuracy_reward() -> None:
    pytest.importorskip("math_verify", reason="pip install math-verify")
    from trl.rewards import accuracy_reward

    rewards = RewardSet(["math_verify"])
    ours = rewards([c for c, _ in CASES], [a for _, a in CASES], [{} for _ in CASES]).total.tolist()
    theirs = accuracy_reward([[{"role": "assistant", "content": c}] for c, _ in CASES], [a for _, a in CASES])
    assert ours == [0.0 if t is None else t for t in theirs]
    assert 0 < sum(ours) < len(CASES)
