"""Training strategy (DeepSpeed ZeRO), process groups, Ray placement and weight sync."""
