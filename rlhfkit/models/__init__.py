"""Loading Hugging Face models and tokenizers, per-token log-probs, LoRA, value heads."""
