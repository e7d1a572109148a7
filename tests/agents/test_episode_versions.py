"""Laying an episode's engine calls onto its trace (rlhfkit/agents/episode_versions.py), by hand."""

from rlhfkit.agents.episode_versions import token_versions

PROMPT = [1, 2]


def test_calls_are_laid_by_position_and_feedback_takes_the_version_before_it():
    # turn 1 in two chunks (versions 0 then 1), feedback [9, 9], turn 2 (version 2)
    response, mask = [5, 6, 7, 9, 9, 8], [1, 1, 1, 0, 0, 1]
    calls = [(2, [5, 6], [0, 0]), (4, [7], [1]), (7, [8], [2])]
    assert token_versions(PROMPT, response, mask, calls) == [0, 0, 1, 1, 1, 2]


def test_tokens_no_call_accounts_for_take_the_oldest_version():
    # the executor re-tokenised: the trace's action tokens are not where the call sampled them
    assert token_versions(PROMPT, [5, 6, 9, 4], [1, 1, 0, 1], [(2, [5, 6], [3, 4]), (5, [7], [5])]) == [3, 4, 4, 3]


def test_no_versioned_call_means_no_versions():
    assert token_versions(PROMPT, [5, 6], [1, 1], []) is None
