"""Environment messages as tokens that continue an episode, without re-tokenizing what the policy sampled.

After a policy turn (the engine's tokens, ending with an end-of-turn token) the environment's messages are rendered
by the chat template and only the difference is appended (TRL's ``_get_tool_suffix_ids``): a small conversation
``[user, assistant]`` is rendered alone and followed by the messages and the next assistant header, the first
render is cut after its last end-of-turn token, and what the second adds after that cut is the suffix (so ChatML's
newline after ``<|im_end|>`` belongs to the suffix, as the policy stopped at ``<|im_end|>``). This is exact only for
a template that renders earlier messages the same whatever follows (prefix-preserving); one that does not is
refused when the renderer is built.

Templates that cannot render tools (titanium's llama3, chatml, qwen3) get the Hermes convention in plain roles: the
tools described in the system message, tool results as one user turn of ``<tool_response>`` blocks.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from titanium.config.errors import ConfigError
from titanium.data.chat import ChatTemplate, Message, Segment, Tools

PROBE_TOOL = "probe"


def describe_tools(tools: Tools) -> str:
    """The tools as a system message tells them to a model whose template cannot render them (Hermes's format)."""
    schemas = "\n".join(json.dumps(tool) for tool in tools)
    return (
        f"You can call these tools:\n<tools>\n{schemas}\n</tools>\n"
        'Call one with <tool_call>{"name": <tool name>, "arguments": <arguments as a JSON object>}</tool_call>; '
        "its result comes back in <tool_response></tool_response>."
    )


class ToolPrompts(ChatTemplate):
    """``template``, with ``tools`` rendered into every prompt that has none of its own (a prompt row's tools column
    wins): as the template's ``tools``, or in the system message for a template that cannot render them."""

    def __init__(self, template: ChatTemplate, tools: Tools) -> None:
        self.template, self.tools = template, tools
        self.stop_ids, self.renders_tools = template.stop_ids, template.renders_tools

    def _checked_segments(self, messages: Sequence[Message], generation: bool, tools: Tools | None) -> list[Segment]:
        tools = tools or self.tools
        if not self.template.renders_tools:
            text = describe_tools(tools)
            if messages and messages[0].role == "system":
                messages = [Message("system", f"{messages[0].content}\n\n{text}"), *messages[1:]]
            else:
                messages = [Message("system", text), *messages]
            tools = None
        return self.template._checked_segments(messages, generation, tools)

    def _segments(self, messages: Sequence[Message], generation: bool, tools: Tools | None) -> list[Segment]:
        return self._checked_segments(messages, generation, tools)


class TurnRenderer:
    """Environment messages -> the token ids that follow a policy turn (see the module docstring)."""

    def __init__(self, template: ChatTemplate) -> None:
        self.template = template
        for probe in ([Message("user", "probe")], [Message("tool", "probe", {"name": PROBE_TOOL})]):
            self.suffix(probe)  # (a template that is not prefix-preserving is refused here, before any episode)

    def renderable(self, messages: Sequence[Message]) -> list[Message]:
        """``messages`` as the template can render them: a template without tools gets each run of tool messages
        as one user turn of ``<tool_response>`` blocks."""
        if self.template.renders_tools:
            return list(messages)
        out: list[Message] = []
        merging = False
        for m in messages:
            if m.role != "tool":
                out.append(m)
            else:
                block = f"<tool_response>\n{m.content}\n</tool_response>"
                out[-1:] = (
                    [Message("user", f"{out[-1].content}\n{block}")] if merging else [*out[-1:], Message("user", block)]
                )
            merging = m.role == "tool"
        return out

    def suffix(self, messages: Sequence[Message]) -> list[int]:
        messages = self.renderable(messages)
        first = Message("user", "dummy")
        tool = next((m for m in messages if m.role == "tool"), None)
        if tool is not None:  # (TRL's dummy: an empty answer calling the tool by name, for templates that need it)
            calls: list[dict[str, Any]] = [
                {"type": "function", "function": {"name": tool.extra.get("name"), "arguments": {}}}
            ]
            answer = Message("assistant", "", {"tool_calls": calls})
        else:
            answer = Message("assistant", "dummy")
        before, _ = self.template.tokenize([first, answer], train_on_input=True)
        after = self.template.prompt([first, answer, *messages])
        ends = [i for i, token in enumerate(before) if token in self.template.stop_ids]
        cut = ends[-1] + 1 if ends else len(before)
        if after[:cut] != before[:cut]:
            raise ConfigError(
                "the chat template renders an answer differently once messages follow it (it is not "
                "prefix-preserving), so an environment's turns cannot be appended to the tokens the policy sampled; "
                "use a template that keeps earlier turns as they are (--chat.chat_template llama3 or chatml, or a "
                "training variant of the tokenizer's template)"
            )
        return after[cut:]
