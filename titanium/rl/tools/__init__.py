"""Tools for multi-turn RL: functions as JSON schemas, tool calls parsed from the policy's text, and a subprocess
sandbox that runs them with time and memory limits."""
