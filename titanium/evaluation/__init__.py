"""lm-evaluation-harness on titanium models: the LM (lm.py), running tasks (harness.py), in training (periodic.py)."""
