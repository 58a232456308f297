"""What every RL objective shares: rollouts and their batches, dynamic sampling, rewards (rule functions and reward
models) and the completions log. Objectives (GRPO, PPO) keep only their advantages and losses."""
