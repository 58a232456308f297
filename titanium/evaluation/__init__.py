"""Measurements that run every N steps besides training: held-out loss (validation) and exact match of generated
answers, behind one interface (periodic)."""
