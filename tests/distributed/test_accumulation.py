"""mark_accumulation_boundary: an engine that only counts micro-batches may not take a token budget."""

from __future__ import annotations

import pytest
from torch import nn

from rlhfkit.distributed.accumulation import mark_accumulation_boundary


def test_an_engine_without_the_setter_is_refused_only_with_a_token_budget():
    counting_only = nn.Linear(2, 2)
    mark_accumulation_boundary(counting_only, True, token_budget=False)  # fixed micro-batches: its counter is right
    with pytest.raises(TypeError, match="set_gradient_accumulation_boundary"):
        mark_accumulation_boundary(counting_only, True, token_budget=True)
