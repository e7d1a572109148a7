"""rlhfkit: Ray-based RLHF and post-training for Hugging Face causal LMs."""

__version__ = "0.1.0"
