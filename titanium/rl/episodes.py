"""Multi-turn episodes through the rollout engine, token in, token out.

Each episode starts from its prompt's tokens. Every round, the engine continues every unfinished episode from its
tokens so far (prompt, the policy's turns, the environment's turns) with ``RolloutEngine.generate``: what it samples
is appended as it is, with its log-probs. A policy turn that ends with an end-of-turn token goes to the episode's
environment (``titanium.rl.env.base``), whose answer is rendered by the chat template and appended as tokens
(``titanium.rl.turns``), never re-tokenizing what the policy wrote, until the environment is done or a cap ends
the episode:

- the episode's budget ``max_new_tokens`` (policy and environment tokens together, TRL's ``max_completion_length``):
  a turn cut there is truncated; an environment answer that would not fit is dropped and the episode ends after the
  policy's turn (counted: ``overflow``), as TRL rolls back a tool result that is too long;
- ``max_turn_tokens`` per policy turn (a turn cut there is truncated);
- ``max_turns`` policy turns: the environment still reads the last one (its reward terms count) but no tool runs
  and nothing more is appended; an episode the environment would have gone on with is counted (``capped``).

The trained row is the prompt (left-padded, as in single-turn rollouts) then the episode: ``response_mask`` is True
on the policy's tokens only (environment tokens carry no loss and no KL) and ``old_logprobs`` are the engine's,
0 on environment tokens. An environment that raises ends its episode where it is (counted: ``env_error``); tool
failures are the model's to read (``titanium.rl.tools.sandbox``). Nothing an environment does stops the run.

Each round calls the engine once for the episodes still going, asking at most for what the widest of them may
still add: an engine re-reads (prefills) each episode's tokens every round (a KV cache is kept within a round).
"""

from __future__ import annotations

import dataclasses
import logging
from collections import Counter
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

from titanium.config.errors import ConfigError
from titanium.config.sections import EnvironmentSection
from titanium.data.chat import ChatTemplate, RowError
from titanium.data.prompts import PromptSample
from titanium.data.tokenizer import Tokenizer, decode_sampled
from titanium.generation.engine import RolloutEngine
from titanium.generation.generate import PROMPT_DOCUMENT, left_pad
from titanium.generation.sampling import SamplingParams
from titanium.rl.env.base import Environment, EnvironmentSpec, EnvReply, PolicyTurn
from titanium.rl.env.registry import environment_spec
from titanium.rl.rewards.functions import Rewards, RewardSet, TrainerState
from titanium.rl.rollout import Rollout
from titanium.rl.tools.loading import reference
from titanium.rl.tools.parsers import TOOL_PARSERS, ToolCall
from titanium.rl.tools.sandbox import ToolResult, ToolSandbox
from titanium.rl.tools.schema import json_schema
from titanium.rl.turns import ToolPrompts, TurnRenderer

logger = logging.getLogger(__name__)

STATS = (
    "turns",
    "tool_calls",
    "tool_ok",
    "tool_error",
    "tool_timeout",
    "env_tokens",
    "capped",
    "overflow",
    "env_error",
)
"""What each episode counts (``Rollout.stats``, logged as ``<objective>/env/<name>``, means per episode): its policy
turns, its tool calls and their outcomes, the environment's tokens, and whether it ended at the turn cap, by an
environment answer too long for its budget, or by an environment that raised."""


def tool_schemas(spec: EnvironmentSpec) -> list[dict[str, Any]]:
    """The JSON schemas the policy is shown of ``spec``'s tools; ConfigError for a tool without one, or a name two
    tools share."""
    schemas = [json_schema(fn) for fn in spec.tools]
    names = [schema["function"]["name"] for schema in schemas]
    if len(set(names)) < len(names):
        raise ConfigError(f"--environment.tools: two tools have the same name ({sorted(names)})")
    return schemas


def check_environment(cfg: EnvironmentSection) -> None:
    """What ``[environment]`` decides, checked before any process starts (titanium.preflight, through the RL
    objectives' ``check_config``): the environment and its arguments, the tools' files and schemas, the parser."""
    spec = environment_spec(cfg)
    if spec is not None:
        tool_schemas(spec)
        for fn in spec.tools:
            reference(fn)  # (a tool process must be able to import it)
        TOOL_PARSERS.load(cfg.tool_parser)


@dataclass
class Episode:
    sample: PromptSample
    env: Environment | None
    tokens: list[int] = field(default_factory=list)
    """After the prompt: the policy's and the environment's tokens, in order."""
    policy: list[bool] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    turn_start: int = 0
    """Where the policy's current turn starts in ``tokens``."""
    messages: list[dict[str, Any]] = field(default_factory=list)
    """The episode as messages after the prompt (TRL's conversational completion), for reward functions."""
    answer: str = ""
    """The last policy turn's text."""
    finished: bool = True
    """False when a token cap cut the last policy turn (truncated)."""
    done: bool = False
    stats: Counter = field(default_factory=Counter)
    rewards: Counter = field(default_factory=Counter)


def refused_tool(call: ToolCall) -> ToolResult:
    """The tool runner of a turn at the turn cap: nothing runs."""
    return ToolResult(call.name, "", "skipped")


class EpisodeRunner:
    """Runs the episodes of a rollout batch (see the module docstring) and makes their rollout."""

    def __init__(
        self,
        spec: EnvironmentSpec,
        cfg: EnvironmentSection,
        template: ChatTemplate,
        tokenizer: Tokenizer,
        max_new_tokens: int,
        max_prompt_len: int,
    ) -> None:
        self.spec, self.cfg, self.tokenizer = spec, cfg, tokenizer
        self.max_new_tokens, self.room = max_new_tokens, max_prompt_len + max_new_tokens
        self.schemas = tool_schemas(spec)
        self.parse = TOOL_PARSERS.load(cfg.tool_parser)
        self.renderer = TurnRenderer(template)
        self.stop_ids = template.stop_ids
        self.prompt_template = ToolPrompts(template, self.schemas) if self.schemas and cfg.describe_tools else template
        """The template prompts are made with: the tools shown to the policy."""
        self.sandbox = None
        if spec.tools:
            names = [schema["function"]["name"] for schema in self.schemas]
            tools = {name: reference(fn) for name, fn in zip(names, spec.tools)}
            limits = (cfg.tool_timeout, cfg.tool_memory_mb, cfg.tool_output_chars, cfg.workers)
            self.sandbox = ToolSandbox(tools, *limits)
        self.pool = ThreadPoolExecutor(cfg.workers, thread_name_prefix="environment")
        self.reward_terms = spec.reward_terms

    def close(self) -> None:
        self.pool.shutdown()
        if self.sandbox is not None:
            self.sandbox.close()

    # ----- running -----

    def run(
        self, engine: RolloutEngine, samples: Sequence[PromptSample], params: SamplingParams, seed: int
    ) -> tuple[list[Episode], int]:
        """One episode per sample (a group's samples repeated), and the policy version that played them."""
        episodes = list(self.pool.map(self._start, samples))
        version, call = engine.synced_version(), 0
        while active := [e for e in episodes if not e.done]:
            limits = [self._limit(e) for e in active]
            longest = max(len(e.sample.prompt) + len(e.tokens) for e in active)
            steps = min(max(limits), self.room - longest)
            out = engine.generate(
                [e.sample.prompt + e.tokens for e in active],
                dataclasses.replace(params, max_new_tokens=steps),
                seed=hash((seed, call)) & 0x7FFF_FFFF_FFFF_FFFF,
            )
            call += 1
            made = out.generation
            rows = made.token_lists(keep_stop=True), made.logprobs.tolist(), made.finished.tolist()
            ended = []
            for e, limit, ids, logprobs, stopped in zip(active, limits, *rows):
                n = min(len(ids), limit)
                e.tokens += ids[:n]
                e.policy += [True] * n
                e.logprobs += logprobs[:n]
                if stopped and n == len(ids):
                    ended.append(e)
                elif n == limit:  # (cut by the episode's or the turn's budget: truncated, the episode ends)
                    self._turn(e)
                    e.finished, e.done = False, True
                # else: cut by this round's steps only; the turn goes on next round
            turns = [self._turn(e) for e in ended]
            replies = list(self.pool.map(self._step, ended, turns))
            for e, turn, reply in zip(ended, turns, replies):
                self._apply(e, turn, reply)
        return episodes, version

    def _start(self, sample: PromptSample) -> Episode:
        try:
            env = self.spec.factory()
            opening = env.reset(sample)
            if opening:  # (the environment's first observation joins the prompt)
                messages = (*sample.messages, *opening)
                sample = dataclasses.replace(sample, prompt=self.prompt_template.prompt(messages), messages=messages)
                if len(sample.prompt) > self.room - self.max_new_tokens:
                    raise ValueError(f"the prompt with the environment's opening has {len(sample.prompt)} tokens")
        except Exception:
            logger.warning("the environment failed to start an episode; it ends at once", exc_info=True)
            episode = Episode(sample, None, done=True)
            episode.stats["env_error"] += 1
            return episode
        return Episode(sample, env)

    def _limit(self, e: Episode) -> int:
        """The most tokens the policy may add to ``e`` now: what its budget and its turn's budget leave."""
        left = self.max_new_tokens - len(e.tokens)
        if self.cfg.max_turn_tokens:
            left = min(left, self.cfg.max_turn_tokens - (len(e.tokens) - e.turn_start))
        return left

    def _text(self, ids: list[int]) -> str:
        if ids and ids[-1] in self.stop_ids:
            ids = ids[:-1]
        return decode_sampled(self.tokenizer, ids)

    def _turn(self, e: Episode) -> PolicyTurn:
        text = self._text(e.tokens[e.turn_start :])
        parsed = self.parse(text)
        turn = PolicyTurn(text, parsed.content, parsed.calls, int(e.stats["turns"]))
        e.stats["turns"] += 1
        e.answer = text
        message: dict[str, Any] = {"role": "assistant", "content": parsed.content if parsed.calls else text}
        if parsed.calls:
            message["tool_calls"] = [call.as_dict() for call in parsed.calls]
        e.messages.append(message)
        return turn

    def _step(self, e: Episode, turn: PolicyTurn) -> EnvReply | None:
        """The environment's reply to ``turn`` (at the turn cap: with no tool run); None if it raised."""
        assert e.env is not None
        last = e.stats["turns"] >= self.cfg.max_turns
        run_tool = refused_tool if last or self.sandbox is None else self.sandbox.call
        try:
            return e.env.step(turn, run_tool)
        except Exception:
            logger.warning("the environment raised on turn %d; its episode ends there", turn.index + 1, exc_info=True)
            return None

    def _apply(self, e: Episode, turn: PolicyTurn, reply: EnvReply | None) -> None:
        e.done = True  # (unless the environment's answer is appended below)
        if reply is None:
            e.stats["env_error"] += 1
            return
        unknown = set(reply.rewards) - set(self.reward_terms)
        if unknown:
            logger.warning("the environment returned reward terms it does not declare (%s); ignored", sorted(unknown))
        for name in self.reward_terms:
            e.rewards[name] += float(reply.rewards.get(name, 0.0))
        for result in reply.tool_results:
            if result.outcome != "skipped":
                e.stats["tool_calls"] += 1
                e.stats[f"tool_{result.outcome}"] += 1
        if reply.done or not reply.messages:
            return
        if e.stats["turns"] >= self.cfg.max_turns:
            e.stats["capped"] += 1
            return
        try:
            suffix = self.renderer.suffix(reply.messages)
        except RowError:  # (e.g. a tool's text holding the template's control tokens)
            logger.warning("the chat template cannot render the environment's answer; its episode ends", exc_info=True)
            e.stats["env_error"] += 1
            return
        if len(e.tokens) + len(suffix) > self.max_new_tokens:
            e.stats["overflow"] += 1
            return
        e.messages.extend(m.as_dict() for m in reply.messages)
        e.tokens += suffix
        e.policy += [False] * len(suffix)
        e.logprobs += [0.0] * len(suffix)
        e.stats["env_tokens"] += len(suffix)
        e.turn_start = len(e.tokens)
        e.done = len(e.tokens) == self.max_new_tokens
        e.finished = not e.done  # (no room left to answer: truncated after the environment's turn)

    # ----- the rollout -----

    def rollout(self, episodes: Sequence[Episode], rewards: RewardSet, state: TrainerState | None = None) -> Rollout:
        """The training rows of ``episodes`` (prompts left-padded, then each episode), scored: ``rewards`` on the
        final answers (batched functions also get each episode's tokens and ``completion_messages``), plus the
        environment's reward terms. ``state``: the training's progress, as reward functions get it."""
        prompts = [e.sample.prompt for e in episodes]
        width = max(1, *(len(e.tokens) for e in episodes))
        tokens = torch.full((len(episodes), width), self.tokenizer.pad_id, dtype=torch.long)
        mask = torch.zeros(len(episodes), width, dtype=torch.bool)
        logprobs = torch.zeros(len(episodes), width)
        for row, e in enumerate(episodes):
            n = len(e.tokens)
            tokens[row, :n] = torch.tensor(e.tokens, dtype=torch.long)
            mask[row, :n] = torch.tensor(e.policy, dtype=torch.bool)
            logprobs[row, :n] = torch.tensor(e.logprobs)
        prompt_tokens, prompt_positions, prompt_documents = left_pad(prompts, self.tokenizer.pad_id)
        steps = torch.arange(1, width + 1)
        return Rollout(
            tokens=torch.cat([prompt_tokens, tokens], dim=1),
            positions=torch.cat([prompt_positions, prompt_positions[:, -1:] + steps], dim=1),
            document_ids=torch.cat([prompt_documents, torch.full_like(tokens, PROMPT_DOCUMENT)], dim=1),
            prompt_width=prompt_tokens.shape[1],
            response_mask=mask,
            finished=torch.tensor([e.finished for e in episodes]),
            old_logprobs=logprobs,
            rewards=self._score(episodes, rewards, state),
            completions=[e.answer for e in episodes],
            stats={name: torch.tensor([float(e.stats[name]) for e in episodes]) for name in STATS},
            transcripts=[decode_sampled(self.tokenizer, e.tokens) for e in episodes],
        )

    def _score(self, episodes: Sequence[Episode], rewards: RewardSet, state: TrainerState | None) -> Rewards:
        bound = rewards.with_tokens(
            [e.sample.prompt for e in episodes],
            [e.tokens for e in episodes],
            [e.sample.trl_prompt for e in episodes],
            state,
            completion_messages=[e.messages for e in episodes],
        )
        scored = bound(
            [e.answer for e in episodes], [e.sample.answer for e in episodes], [e.sample.row for e in episodes]
        )
        if not self.reward_terms:
            return scored
        terms = {name: torch.tensor([e.rewards[name] for e in episodes]) for name in self.reward_terms}
        total = scored.total + sum(terms.values())
        return dataclasses.replace(scored, total=total, per_function={**scored.per_function, **terms})
