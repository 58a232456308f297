"""lm-evaluation-harness on titanium models: the LM (lm.py), running tasks (harness.py), during training (periodic.py)."""
