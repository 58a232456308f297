"""Generation: batched sampling and greedy decoding with a KV cache, RL rollouts, and exact-match evaluation."""
