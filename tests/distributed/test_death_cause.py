"""`death_cause`: the one line a run prints when a role's Ray actor dies, from Ray's own ActorDiedError text."""

from __future__ import annotations

from rlhfkit.distributed.ray_groups import death_cause

# The shape of Ray 2.60's ActorDiedError message (ray/exceptions.py): a base line, tab-indented fields, the cause.
NODE_DIED = """The actor died unexpectedly before finishing this task.
\tclass_name: RoleWorker
\tactor_id: 6a7c
\tpid: 4711
\tnamespace: 9d1e
\tip: 10.0.0.7
The actor is dead because its node has died. Node Id: 52b4c3e1f0
\tthe actor's node was terminated expectedly: received SIGTERM"""
PROCESS_DIED = """The actor died unexpectedly before finishing this task.
\tclass_name: RoleWorker
\tip: 10.0.0.7
The actor is dead because its worker process has died. Worker exit type: SYSTEM_ERROR"""


def test_a_lost_node_is_named_with_its_ip():
    assert death_cause(NODE_DIED) == "node 10.0.0.7: The actor is dead because its node has died. Node Id: 52b4c3e1f0"


def test_other_deaths_keep_the_first_line():
    assert death_cause(PROCESS_DIED) == "The actor died unexpectedly before finishing this task."
    assert death_cause("") == "no reason given"
