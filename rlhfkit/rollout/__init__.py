"""Rollout: generation engines behind one interface (Transformers here, vLLM next) and reward sources."""

from rlhfkit.rollout.engine import FINISH_LENGTH, FINISH_STOP, RolloutEngine, SampledSequence

__all__ = ["FINISH_LENGTH", "FINISH_STOP", "RolloutEngine", "SampledSequence"]
