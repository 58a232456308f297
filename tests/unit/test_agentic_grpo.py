"""GRPO with an environment in the real loop, one process: a policy that calls tools that raise, hang, print
megabytes, return huge or non-text results, call tools that do not exist and never stop calling is answered,
counted and capped while the run goes on (the tools run in their sandbox; the engine is scripted, so every
failure happens on cue); the completions table shows whole episodes; and the bundled calculator task trains with
titanium's own engine and a policy lag."""

from __future__ import annotations

import math
from typing import Any

from tests.helpers import LOSS_TAG, REPO, scalars, tiny_args, train_until_first_save
from tests.objectives.scripted_engine import ScriptedEngine
from titanium.data.tokenizer import DEFAULT_TOKENIZER_PATH, TiktokenTokenizer

TOKENIZER = TiktokenTokenizer(str(REPO / DEFAULT_TOKENIZER_PATH))
EOT = TOKENIZER.special_tokens["<|eot_id|>"]
TOOLS = ("fails", "hangs", "chatty", "huge", "binary")
EPISODES = (
    "--data.kind", "chat", "--data.path", "assets/tasks/calculator/train.jsonl", "--chat.chat_template", "llama3",
    "--training.local_batch_size", "8", "--optimizer.lr", "1e-4",
    "--training.seq_len", "512", "--rl.max_prompt_len", "32", "--rl.max_new_tokens", "480",
    "--rl.rewards", "tests.objectives.fixed_rollouts:characters",
)  # fmt: skip
AGENTIC = ("--training.objective", "grpo", "--grpo.group_size", "4", *EPISODES)


TURNS = ['[fails(x="y")]', "[hangs()]", "[chatty(), huge(), binary()]", "[nope()]", '[fails("y")]']
"""The scripted policy's turns: a tool that raises, one that hangs, three that misbehave at once, an unknown tool,
a malformed call (arguments by position), and then that call again and again (it never stops calling)."""


def scripted(ids: list[int]) -> list[int]:
    turn = TOKENIZER.decode(ids).count("<|start_header_id|>assistant") - 1
    return TOKENIZER.encode(TURNS[min(turn, len(TURNS) - 1)], bos=False, eos=False) + [EOT]


def test_misbehaving_tools_and_a_policy_that_never_stops_are_counted_and_capped(make_trainer, monkeypatch, tmp_path):
    monkeypatch.setattr(
        "titanium.rl.source.build_engine", lambda *a, stop_ids, pad_id, **k: ScriptedEngine(scripted, stop_ids, pad_id)
    )
    tools = [f"tests.objectives.tools:{name}" for name in TOOLS]
    args = (
        *AGENTIC, "--training.steps", "1", "--environment.tools", *tools, "--environment.max_turns", "6",
        "--environment.tool_parser", "pythonic",
        "--environment.tool_timeout", "1", "--environment.tool_output_chars", "200", "--environment.workers", "8",
        "--rl.log_completions", "1", "--rl.log_completions_count", "1", "--environment.no_describe_tools",
    )  # fmt: skip
    trainer = make_trainer(*tiny_args(tmp_path, *args))
    tables: list[Any] = []
    log_table = trainer.metrics.log_table
    trainer.metrics.log_table = lambda step, name, table: (tables.append(table), log_table(step, name, table))
    trainer.train()
    metric = {name: scalars(tmp_path / "tb", f"grpo/env/{name}")[1] for name in ("turns", "tool_calls", "capped")}
    metric.update({name: scalars(tmp_path / "tb", f"grpo/env/tool_{name}")[1] for name in ("ok", "error", "timeout")})
    # each episode: 6 turns (capped), 5 of them answered: fails, hangs, chatty + huge + binary, nope, broken
    assert metric == {"turns": 6, "tool_calls": 7, "capped": 1, "ok": 1, "error": 5, "timeout": 1}, metric
    assert math.isfinite(scalars(tmp_path / "tb", LOSS_TAG)[1])
    ((_, episode, *_),) = tables[0].rows
    for seen in ("ValueError: no y", "timed out after 1 s", "done", "more than the limit of 200",
                 "returned a bytes, not text", "unknown tool 'nope'", "passes arguments by position"):  # fmt: skip
        assert seen in episode, seen
    assert episode.count("<|start_header_id|>assistant") == 5  # (the 6th turn's call is not answered)


def test_the_calculator_task_trains_with_titanium_engine(make_trainer, tmp_path) -> None:
    """Two steps from random weights, the next batch generated while one trains (lag 1): the episodes are played
    and scored, and the environment's metrics are logged."""
    args = (
        *AGENTIC, "--training.steps", "2", "--environment.name", "calculator", "--environment.tool_parser",
        "pythonic", "--environment.no_describe_tools", "--environment.max_turn_tokens", "16",
        "--rl.max_policy_lag", "1", "--rl.rewards", "exact_match",
    )  # fmt: skip
    trainer = make_trainer(*tiny_args(tmp_path, *args))
    trainer.train()
    assert sorted(scalars(tmp_path / "tb", "grpo/env/turns")) == [1, 2]
    assert scalars(tmp_path / "tb", "grpo/policy_lag")[2] == 1
    assert all(math.isfinite(v) for v in scalars(tmp_path / "tb", LOSS_TAG).values())


def test_a_tool_file_that_does_not_import_stops_the_run_before_it_starts(tmp_path) -> None:
    """Exit code 2, nothing trained (an environment file the same: tests/unit/test_episodes.py)."""
    from titanium.train import main

    args = (*AGENTIC, "--environment.tools", "tests/objectives/broken_tools.py:tool", "--training.steps", "1")
    assert main(tiny_args(tmp_path, *args)) == 2
    assert not (tmp_path / "tb").exists()


def test_ppo_trains_on_episodes(make_trainer, tmp_path) -> None:
    """PPO draws episodes from the same source: its value model and GAE run over the policy's tokens."""
    args = (
        "--training.objective", "ppo", *EPISODES, "--training.steps", "1", "--environment.name", "calculator",
        "--environment.tool_parser", "pythonic", "--environment.no_describe_tools",
        "--environment.max_turn_tokens", "16", "--ppo.ppo_epochs", "1", "--rl.rewards", "exact_match",
    )  # fmt: skip
    make_trainer(*tiny_args(tmp_path, *args)).train()
    assert sorted(scalars(tmp_path / "tb", "ppo/env/turns")) == [1]
    assert math.isfinite(scalars(tmp_path / "tb", "ppo/value_loss")[1])


def test_a_run_resumed_mid_batch_trains_on_the_same_episodes(make_trainer, tmp_path) -> None:
    """The calculator task, a rollout batch every 2 steps (minibatches 2), killed after its step-1 checkpoint (in the
    middle of a batch): the resumed run trains on the saved episodes, then plays the next batch from the same
    prompts and seeds, and logs the uninterrupted run's losses and environment metrics."""
    from titanium.parallel.distributed import shutdown_distributed

    common = (
        *AGENTIC, "--training.steps", "3", "--grpo.minibatches", "2", "--environment.name", "calculator",
        "--environment.tool_parser", "pythonic", "--environment.no_describe_tools", "--environment.max_turn_tokens",
        "12", "--rl.rewards", "exact_match", "--debug.deterministic", "--checkpoint.enable", "--checkpoint.interval",
        "1",
    )  # fmt: skip
    make_trainer(*tiny_args(tmp_path / "straight", *common)).train()
    shutdown_distributed()
    train_until_first_save(make_trainer, *tiny_args(tmp_path / "resumed", *common), at_step=1)
    resumed = make_trainer(*tiny_args(tmp_path / "resumed", *common))
    assert resumed.train_state.step == 1
    resumed.train()
    for tag in (LOSS_TAG, "grpo/reward", "grpo/env/turns", "grpo/env/env_tokens"):
        expected, got = scalars(tmp_path / "straight/tb", tag), scalars(tmp_path / "resumed/tb", tag)
        assert [got[s] for s in (2, 3)] == [expected[s] for s in (2, 3)], tag
