"""Batch inference and interactive chat on the rollout engines."""
