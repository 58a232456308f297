"""TRL's tool loop as an environment (``--environment.name tools``, the default when only tools are given): every
tool call of a turn runs, in order, and its result is the policy's next message; a turn without a call is the
answer and ends the episode. As ``GRPOTrainer(tools=...)``'s ``_tool_call_loop``, with the calls sandboxed."""

from __future__ import annotations

from titanium.rl.env.base import Environment, EnvReply, PolicyTurn, ToolRunner, tool_messages


class ToolLoop(Environment):
    def step(self, turn: PolicyTurn, run_tool: ToolRunner) -> EnvReply:
        if not turn.tool_calls:
            return EnvReply(done=True)
        results = [run_tool(call) for call in turn.tool_calls]
        return EnvReply(tool_messages(results), tool_results=results)
