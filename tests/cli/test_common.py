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
