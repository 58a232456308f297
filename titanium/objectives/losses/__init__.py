"""Losses as plain functions of tensors (cross-entropy, preference, GRPO, PPO, distillation, reward), each checked
against its peer's own code; the objectives in the package above run them in the loop."""
