"""Atomic, resumable checkpoints."""
