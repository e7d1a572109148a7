"""The RL stack: rollout source, experience, roles, the trainer, sync and async drivers."""
