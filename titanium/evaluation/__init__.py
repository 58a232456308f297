"""Measurements that run every N steps besides training, behind one interface (periodic.py): held-out loss
(validation.py), exact match of generated answers (exact_match.py) and lm-evaluation-harness tasks (lm_eval.py,
through titanium's lm-eval model in lm.py and the task glue in harness.py; the eval tool uses them too)."""
