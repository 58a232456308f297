"""Environments of multi-turn episodes: the protocol (``base``), TRL's tool loop (``tool_loop``), the bundled tasks
(``calculator``, ``guess_number``) and adapters for verifiers and OpenEnv environments."""
