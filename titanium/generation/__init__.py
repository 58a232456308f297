"""Generation: batched greedy decoding with a KV cache, and the exact-match evaluation built on it."""
