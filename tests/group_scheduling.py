"""make test's pytest-xdist scheduler: each group of tests/selection.py ("ray", or a test's module) goes whole to
one worker, groups in collection order (tests/selection.py puts the slow ones first). Imported only under xdist."""

from __future__ import annotations

from xdist.scheduler import LoadScopeScheduling

from tests.selection import group_of


class GroupScheduling(LoadScopeScheduling):
    """xdist's scope scheduling with our groups as scopes and the workers' collection order kept (xdist would put the
    groups with the most tests first, whatever their duration)."""

    def __init__(self, config, log=None):
        super().__init__(config, log)
        config.option.loadscopereorder = False

    def _split_scope(self, nodeid: str) -> str:
        return group_of(nodeid)
