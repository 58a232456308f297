"""Multi-turn episodes in one process (titanium/rl/episodes.py): the rows are the engine's tokens and the chat
template's rendering of the environment's turns, masked out of the loss; the caps end episodes and are counted; an
environment that raises ends only its own episode; a one-turn environment makes today's single-turn rows; and with
titanium's engine the trained sequence is the sampled one (its log-probs equal a training forward's)."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch

from tests.objectives.scripted_engine import ScriptedEngine, made_up_logprob
from titanium.config.errors import ConfigError
from titanium.config.sections import EnvironmentSection
from titanium.data.chat import Message, build_chat_template
from titanium.data.prompts import PromptSample
from titanium.data.tokenizer import DEFAULT_TOKENIZER_PATH, ByteTokenizer, TiktokenTokenizer
from titanium.generation.sampling import SamplingParams
from titanium.generation.titanium_engine import TitaniumEngine
from titanium.models import get_model_spec
from titanium.models.llama3 import LLAMA3_FLAVORS
from titanium.rl.dynamic import concat_rollouts, take_rows
from titanium.rl.env.base import Environment, EnvReply, PolicyTurn, ToolRunner, tool_messages
from titanium.rl.env.registry import environment_spec
from titanium.rl.episodes import EpisodeRunner
from titanium.rl.rewards.functions import RewardSet
from titanium.rl.rollout import response_logprobs, to_rollout
from titanium.rl.tools.sandbox import ToolResult
from titanium.rl.turns import TurnRenderer

TOKENIZER = TiktokenTokenizer(DEFAULT_TOKENIZER_PATH)
TEMPLATE = build_chat_template("llama3", TOKENIZER, "llama3")
EOT = TOKENIZER.special_tokens["<|eot_id|>"]
PARAMS = SamplingParams(max_new_tokens=200, temperature=1.0)
CALL = '[calculate(expression="{}")]'
QUESTIONS = {"What is 47 * 38?": ("47 * 38", "1786"), "What is 347 + 589?": ("347 + 589", "936")}


def encode(text: str) -> list[int]:
    return TOKENIZER.encode(text, bos=False, eos=False)


def sample(question: str, answer: str, template: Any = TEMPLATE) -> PromptSample:
    messages = (Message("user", question),)
    return PromptSample(template.prompt(list(messages)), answer, {"answer": answer}, messages=messages)


def runner(name: str = "calculator", budget: int = 160, **options: Any) -> EpisodeRunner:
    cfg = EnvironmentSection(name=name, tool_parser="pythonic", describe_tools=False, **options)
    spec = environment_spec(cfg)
    assert spec is not None
    return EpisodeRunner(spec, cfg, TEMPLATE, TOKENIZER, budget, max_prompt_len=64)


def play(run: EpisodeRunner, respond: Any, samples: list[PromptSample], rewards: tuple[str, ...] = ("exact_match",)):
    engine = ScriptedEngine(respond, TEMPLATE.stop_ids, TOKENIZER.pad_id)
    try:
        episodes, _ = run.run(engine, samples, PARAMS, seed=0)
        return run.rollout(episodes, RewardSet(list(rewards))), engine
    finally:
        run.close()


def calculator_policy(ids: list[int]) -> list[int]:
    """Call the tool on the question's expression, then answer with its result; "guess" questions answer 7."""
    text = TOKENIZER.decode(ids)
    if "<tool_response>" in text:
        return encode(text.rsplit("<tool_response>\n", 1)[1].split("\n", 1)[0]) + [EOT]
    if "guess" in text:
        return encode("7") + [EOT]
    expression = next(e for q, (e, _) in QUESTIONS.items() if q in text)
    return encode(CALL.format(expression)) + [EOT]


def test_rows_are_the_engine_tokens_and_the_rendered_tool_turns() -> None:
    samples = [sample(q, a) for q, (_, a) in QUESTIONS.items()] + [sample("Please guess 3 * 3", "9")]
    out, _ = play(runner(), calculator_policy, samples)
    assert out.rewards.total.tolist() == [1.0, 1.0, 0.0] and out.completions == ["1786", "936", "7"]
    tool_turns, width = TurnRenderer(TEMPLATE), out.response_mask.shape[1]
    for row, (expression, result) in enumerate(QUESTIONS.values()):
        call, answer = encode(CALL.format(expression)) + [EOT], encode(result) + [EOT]
        tool = tool_turns.suffix(tool_messages([ToolResult("calculate", result, "ok")]))
        assert TOKENIZER.decode(tool) == (
            "<|start_header_id|>user<|end_header_id|>\n\n<tool_response>\n"
            f"{result}\n</tool_response><|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n"
        )
        episode, n, prompt = call + tool + answer, len(call + tool + answer), samples[row].prompt
        assert out.tokens[row, out.prompt_width - len(prompt) : out.prompt_width].tolist() == prompt
        assert out.tokens[row, out.prompt_width :].tolist() == episode + [TOKENIZER.pad_id] * (width - n)
        policy = [True] * len(call) + [False] * len(tool) + [True] * len(answer)
        assert out.response_mask[row].tolist() == policy + [False] * (width - n)
        engine = [made_up_logprob(len(prompt) + i, t) if p else 0.0 for i, (t, p) in enumerate(zip(episode, policy))]
        assert torch.equal(out.old_logprobs[row, :n], torch.tensor(engine))
        assert out.stats["env_tokens"][row] == len(tool)
    assert out.response_mask[2].sum() == 2 and not out.response_mask[2, 2:].any()  # (answered at once)
    assert {k: v.tolist() for k, v in out.stats.items() if k.startswith(("turns", "tool_"))} == {
        "turns": [2, 2, 1], "tool_calls": [1, 1, 0], "tool_ok": [1, 1, 0], "tool_error": [0, 0, 0],
        "tool_timeout": [0, 0, 0],
    }  # fmt: skip
    assert out.finished.all() and "<tool_response>" in out.transcripts[0]
    again = concat_rollouts([out, take_rows(out, [2, 0])], TOKENIZER.pad_id)  # (as dynamic sampling refills)
    assert again.transcripts == [*out.transcripts, out.transcripts[2], out.transcripts[0]]
    assert again.stats["turns"].tolist() == [2, 2, 1, 1, 2] and torch.equal(
        again.response_mask[3:], out.response_mask[[2, 0]]
    )
    steps = torch.arange(1, width + 1)
    assert torch.equal(
        out.positions[:, out.prompt_width :], out.positions[:, out.prompt_width - 1 : out.prompt_width] + steps
    )


class Stubborn(Environment):
    """Always answers, never done (a model that never stops calling tools, seen from the environment)."""

    def step(self, turn: PolicyTurn, run_tool: ToolRunner) -> EnvReply:
        results = [run_tool(call) for call in turn.tool_calls]
        return EnvReply(tool_messages(results) or [Message("user", "again")], tool_results=results)


def always_calls(ids: list[int]) -> list[int]:
    return encode(CALL.format("1 + 1")) + [EOT]


def test_the_caps_end_episodes_and_are_counted() -> None:
    samples = [sample("What is 47 * 38?", "1786")]
    out, engine = play(runner(max_turns=3), always_calls, samples)  # never stops calling: capped at 3 turns
    stats = {k: v.item() for k, v in out.stats.items()}
    assert stats["turns"] == 3 and stats["capped"] == 1 and stats["tool_calls"] == stats["tool_ok"] == 2
    assert len(engine.calls) == 3 and out.finished.all()
    assert out.completions == [CALL.format("1 + 1")] and out.rewards.total.item() == 0

    out, _ = play(runner(budget=40, max_turns=5), always_calls, samples)  # the tool's answer would not fit
    assert out.stats["overflow"].item() == 1 and out.stats["turns"].item() == 1 and out.finished.all()
    assert out.response_mask.sum() == len(always_calls([]))

    out, _ = play(runner(max_turns=5, max_turn_tokens=6), always_calls, samples)  # a turn cut: truncated
    assert out.response_mask.sum() == 6 and not out.finished.any() and out.stats["turns"].item() == 1

    stubborn = runner("tests.unit.test_episodes:Stubborn", max_turns=4)  # (an environment given by import path)
    out, _ = play(stubborn, lambda ids: encode("no") + [EOT], samples)
    assert out.stats["turns"].item() == 4 and out.stats["capped"].item() == 1 and out.stats["tool_calls"].item() == 0


class Flaky(Environment):
    """Raises on the policy's second turn of questions about 47 *, and at reset for those about 5 *."""

    reward_terms = ("turn_bonus",)

    def reset(self, sample: PromptSample) -> None:
        if "5 *" in sample.as_written:
            raise RuntimeError("cannot start")
        self.question = sample.as_written

    def step(self, turn: PolicyTurn, run_tool: ToolRunner) -> EnvReply:
        if turn.index == 1 and "47 *" in self.question:
            raise RuntimeError("broken")
        return EnvReply([Message("user", "go on")], done=turn.index == 2, rewards={"turn_bonus": 0.5})


def test_an_environment_that_raises_ends_only_its_own_episode() -> None:
    samples = [sample("What is 47 * 38?", "1786"), sample("What is 5 * 5?", "25"), sample("What is 347 + 589?", "936")]
    out, _ = play(runner("tests.unit.test_episodes:Flaky"), lambda ids: encode("9") + [EOT], samples)
    assert out.stats["env_error"].tolist() == [1, 1, 0] and out.stats["turns"].tolist() == [2, 0, 3]
    assert out.response_mask.sum(dim=1).tolist() == [4, 0, 6]
    assert out.rewards.per_function["turn_bonus"].tolist() == [0.5, 0.0, 1.5]  # (the terms of the turns it took)
    assert out.rewards.total.tolist() == [0.5, 0.0, 1.5]


class OneTurn(Environment):
    def step(self, turn: PolicyTurn, run_tool: ToolRunner) -> EnvReply:
        return EnvReply(done=True)


def test_a_one_turn_environment_makes_the_single_turn_rows() -> None:
    samples = [sample(q, a) for q, (_, a) in QUESTIONS.items()]
    lengths = iter([5, 9])

    def respond(ids: list[int]) -> list[int]:  # (one truncated at the budget of 8, one finished)
        n = next(lengths)
        return [(i * 7 + len(ids)) % 500 + 100 for i in range(n - 1)] + [EOT]

    run = runner("tests.unit.test_episodes:OneTurn", budget=8)
    engine = ScriptedEngine(respond, TEMPLATE.stop_ids, TOKENIZER.pad_id)
    episodes, _ = run.run(engine, samples, PARAMS, seed=0)
    rewards = RewardSet(["exact_match"])
    multi = run.rollout(episodes, rewards)
    run.close()
    ((prompts, _),) = engine.calls
    lengths = iter([5, 9])
    single = to_rollout(
        samples,
        1,
        engine.generate(prompts, dataclasses.replace(PARAMS, max_new_tokens=8), 0).generation,
        rewards,
        TOKENIZER,
    )
    for name in ("tokens", "positions", "document_ids", "response_mask", "finished", "old_logprobs"):
        assert torch.equal(getattr(multi, name), getattr(single, name)), name
    assert multi.completions == single.completions and torch.equal(multi.rewards.total, single.rewards.total)
    assert multi.finished.tolist() == [True, False]


def test_bad_environment_config_is_refused_before_start() -> None:
    with pytest.raises(ConfigError, match="does not import"):
        environment_spec(EnvironmentSection(tools=["tests/objectives/broken_tools.py:tool"]))
    with pytest.raises(ConfigError, match="--environment.name .*does not import"):
        environment_spec(EnvironmentSection(name="tests/objectives/broken_tools.py:Env"))
    with pytest.raises(ConfigError, match="not a known environment"):
        environment_spec(EnvironmentSection(name="no_such_environment"))
    with pytest.raises(ConfigError, match="not an Environment class"):
        environment_spec(EnvironmentSection(name="tests.objectives.tools:add"))
    with pytest.raises(ConfigError, match="does not take them"):
        environment_spec(EnvironmentSection(name="guess_number", args='{"nope": 1}'))
    with pytest.raises(ConfigError, match="not JSON"):
        environment_spec(EnvironmentSection(name="guess_number", args="{nope"))
    assert environment_spec(EnvironmentSection()) is None  # (off: single-turn rollouts)
    spec = environment_spec(EnvironmentSection(tools=["tests.objectives.tools:add"]))
    assert spec is not None and [t.__name__ for t in spec.tools] == ["add"] and spec.reward_terms == ()


def test_token_in_token_out_with_the_titanium_engine() -> None:
    """A random policy plays the guessing game with titanium's engine: every policy token of every row is the token
    the engine sampled (recorded call by call), and the engine's log-probs equal a training forward's over the rows
    (so the importance ratio starts at 1 and the trained sequence is the sampled one)."""
    tokenizer = ByteTokenizer()
    template = build_chat_template("llama3", tokenizer, "llama3")
    spec = get_model_spec("llama3")
    args = dataclasses.replace(
        LLAMA3_FLAVORS["debugmodel"], n_layers=2, dim=64, n_heads=4, n_kv_heads=2, vocab_size=tokenizer.vocab_size,
        max_seq_len=256,
    )  # fmt: skip
    model = spec.model_cls(args)
    model.init_weights(seed=0)
    model.eval()
    stops = template.stop_ids | set(b"0123456789aeiou")  # (turns of a random policy end soon)
    engine = TitaniumEngine(spec, args, stop_ids=stops, pad_id=tokenizer.pad_id, device=torch.device("cpu"))
    engine.sync_from(model, version=3)
    sampled: list[list[list[int]]] = []
    generate = engine.generate

    def recorded(prompts: Any, params: SamplingParams, seed: int) -> Any:
        out = generate(prompts, params, seed)
        sampled.append(out.generation.token_lists(keep_stop=True))
        return out

    engine.generate = recorded  # type: ignore[method-assign]
    cfg = EnvironmentSection(name="guess_number", max_turns=3, max_turn_tokens=8)
    environment = environment_spec(cfg)
    assert environment is not None
    run = EpisodeRunner(environment, cfg, template, tokenizer, max_new_tokens=120, max_prompt_len=80)
    samples = [sample("Guess my number from 1 to 20.", str(n), template) for n in (3, 11, 17, 4)]
    episodes, version = run.run(engine, samples, SamplingParams(120, temperature=1.0), seed=5)
    out = run.rollout(episodes, RewardSet(["exact_match"]))
    run.close()
    assert version == 3 and out.stats["turns"].sum() > len(samples) and out.stats["env_tokens"].sum() > 0
    per_row: list[list[int]] = [[] for _ in samples]
    for call in sampled:  # (each call's rows are the episodes still going, in order)
        going = [e for e in range(len(samples)) if len(per_row[e]) < out.response_mask[e].sum()]
        for e, ids in zip(going, call):
            per_row[e] += ids[: int(out.response_mask[e].sum()) - len(per_row[e])]
    for row in range(len(samples)):
        policy_tokens = out.tokens[row, out.prompt_width :][out.response_mask[row]].tolist()
        assert policy_tokens == per_row[row], row
    with torch.no_grad():
        logits = model(out.tokens, positions=out.positions, document_ids=out.document_ids)
    forward = response_logprobs(logits, out.tokens, out.response_mask.shape[1], 1.0) * out.response_mask
    torch.testing.assert_close(forward, out.old_logprobs, rtol=0, atol=2e-5)
    assert (out.old_logprobs[out.response_mask] != 0).all() and (out.old_logprobs[~out.response_mask] == 0).all()
