"""The policy version of every token of an agent episode (asynchronous training with --partial_rollout).

With --partial_rollout a weight update may land between any two engine calls of an episode: between its turns, and
between the chunks of one turn (rlhfkit.rl.async_generator.VersionedEngine). Each engine call returns the version
that sampled each of its tokens (`SampledSequence.versions`); `BatchingGenerator` keeps every call of an episode
as (context length, sampled ids, versions), and `token_versions` lays them onto the finished episode's response by
position. The context only ever grows (token in, token out: rlhfkit.agents.api), so a call whose context was the
first k tokens of the episode's trace sampled the response tokens from k - len(prompt) on.

What no call accounts for: a feedback token (action mask 0, never trained) takes the version of the token before
it; an action token (an executor that re-tokenised text instead of keeping the sampled ids) takes the oldest
version of the episode's calls, the conservative choice for staleness.
"""

from __future__ import annotations

from collections.abc import Sequence

#: One engine call of an episode: (length of the context it continued, the ids it sampled, their versions).
Call = tuple[int, list[int], list[int]]


def token_versions(prompt_ids: Sequence[int], response_ids: Sequence[int], action_mask: Sequence[int],
                   calls: Sequence[Call]) -> list[int] | None:
    """Per response token, the policy version that sampled it (see the module docstring); None when no call of
    the episode carried versions (a synchronous run)."""
    oldest = min((v for _, _, versions in calls for v in versions), default=None)
    if oldest is None:
        return None
    laid: list[int | None] = [None] * len(response_ids)
    for context_len, ids, versions in calls:
        start = context_len - len(prompt_ids)
        if start < 0 or list(response_ids[start:start + len(ids)]) != list(ids):
            continue  # the episode's trace does not hold these tokens where the call sampled them
        laid[start:start + len(ids)] = versions
    out: list[int] = []
    for i, version in enumerate(laid):
        if version is None:
            feedback = i < len(action_mask) and not action_mask[i]
            version = out[-1] if feedback and out else oldest
        out.append(version)
    return out
