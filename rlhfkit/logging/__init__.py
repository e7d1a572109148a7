"""Metric sinks (console progress, JSONL, TensorBoard, Weights & Biases)."""
