"""The bundled tool task: arithmetic questions the debug model cannot work out in its head, and a ``calculate``
tool that can (``--environment.name calculator``; data in assets/tasks/calculator). The episode is TRL's tool loop;
the reward is ``exact_match`` of the final answer, so calling the tool and copying its result is what pays."""

from __future__ import annotations

from titanium.rl.env.tool_loop import ToolLoop
from titanium.rl.tools.calculator import calculate


class Calculator(ToolLoop):
    tools = (calculate,)
