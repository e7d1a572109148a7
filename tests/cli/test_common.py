"""What every entry point shares: quiet logs without hiding other libraries' warnings, one-line user errors."""

from __future__ import annotations

import warnings

from rlhfkit.cli.common import quiet_libraries, run_cli
from rlhfkit.errors import Preempted, UserError


def test_quiet_libraries_does_not_hide_library_warnings():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")
        quiet_libraries()
        warnings.warn("a library's UserWarning", UserWarning, stacklevel=1)
        warnings.warn("a library's FutureWarning", FutureWarning, stacklevel=1)
    assert {str(w.message) for w in caught} >= {"a library's UserWarning", "a library's FutureWarning"}


def test_run_cli_exit_codes(capsys):
    def user_mistake(argv):
        raise UserError("--flag x: what is wrong, how to fix")

    def preempted(argv):
        raise Preempted("stopped by SIGTERM after step 3; run the same command with --load_checkpoint")

    assert run_cli(user_mistake, [], prog="p") == 2
    assert capsys.readouterr().err == "p: error: --flag x: what is wrong, how to fix\n"
    assert run_cli(preempted, [], prog="p") == 0
    assert "--load_checkpoint" in capsys.readouterr().err


def test_a_user_error_raised_in_a_ray_actor_is_still_one_line(capsys):
    class RayTaskErrorLike(UserError):  # Ray re-raises an actor's exception as a subclass holding it in `cause`
        def __init__(self, cause: UserError):
            super().__init__(f"ray::EngineActor.generate_episodes() (pid=1)\nTraceback (most recent call last):\n"
                             f"  ...\n{cause}")
            self.cause = cause

    def in_actor(argv):
        raise RayTaskErrorLike(UserError("agent a.py: AgentExecutor() raised ValueError: no config"))

    assert run_cli(in_actor, [], prog="p") == 2
    assert capsys.readouterr().err == "p: error: agent a.py: AgentExecutor() raised ValueError: no config\n"
