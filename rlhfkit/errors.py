"""The one exception type for user mistakes.

A `UserError` means the input was wrong (a path, a flag, a record), not that rlhfkit is broken. The CLI entry
points catch it, print its message as one line and exit with code 2, without a traceback. The message should say
what is wrong, where, and how to fix it.
"""


class UserError(Exception):
    """Bad user input: reported as one line on stderr with exit code 2."""

    exit_code = 2


class Preempted(Exception):
    """The run was asked to stop (SIGTERM, as schedulers and spot instances send) and saved a checkpoint at a step
    boundary. Not an error: the CLI prints the message (how to resume) and exits with code 0."""

    exit_code = 0


class ComponentFailed(Exception):
    """A part of the run (a Ray role actor, a rollout engine, a reward server) died or stopped answering: the run
    stops with one line naming it and the cause (exit code 1); a rerun with --load_checkpoint continues."""

    exit_code = 1
