"""Rewards for RL: rule functions by name or import path, weighted sums, and reward models scoring responses."""
