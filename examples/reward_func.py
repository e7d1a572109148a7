"""Rule-based reward for the demo tasks, in the OpenRLHF `--remote_rm_url reward_func.py` form.

A reward file defines `reward_func(queries, prompts, labels)`: `queries` are the full texts (prompt + response),
`prompts` the prompt texts and `labels` each record's `--label_key` field. It returns the rewards (a tensor or a list
of numbers), or a dict with `rewards` (for advantages), optional `scores` (for dynamic filtering) and optional
`extra_logs` (logged means). This one returns lists: its worker processes then never import torch.
This one gives 1.0 for an exactly right answer and 0.0 otherwise; its code is `rlhfkit/demo/reward_func.py` (the
demo uses it from the package, so `rlhfkit demo` works without this repository):

    python -m rlhfkit.cli.train_ppo_ray ... --remote_rm_url examples/reward_func.py --label_key answer
"""

from rlhfkit.demo.reward_func import reward_func

__all__ = ["reward_func"]
