"""Reward sources: reward functions, HTTP rewards, the reward-model server, the user-code pool, the sandbox."""
