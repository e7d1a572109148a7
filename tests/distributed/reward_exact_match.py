"""Reward function file for Ray RL tests (`--remote_rm_url`).

The exact-match reward of the demo tasks is 0 for every sample of a random-init model, so group estimators would
see no signal; a bonus that is a deterministic hash of the response text in [0, 1] makes any two different
responses of a prompt (almost surely) score differently, so every step has non-zero advantages.
"""

from rlhfkit.demo.tasks import is_correct


def reward_func(queries, prompts, labels):
    rewards = []
    for query, prompt, label in zip(queries, prompts, labels):
        response = query[len(prompt):]
        rewards.append(float(is_correct(response, label)) + (sum(map(ord, response)) % 101) / 100)
    return {"rewards": rewards, "scores": [float(is_correct(q[len(p):], a)) for q, p, a in
                                           zip(queries, prompts, labels)]}
