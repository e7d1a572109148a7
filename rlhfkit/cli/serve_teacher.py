"""`python -m rlhfkit.cli.serve_teacher --pretrain DIR --port N`: serve a distillation teacher over HTTP.

Students reach it with `--teacher_url http://HOST:N` (protocol in rlhfkit/rl/teacher_server.py). Binds 127.0.0.1
unless --host says otherwise. With a key (--api_key or RLHFKIT_TEACHER_API_KEY) every request needs
`Authorization: Bearer <key>`, which students send with --teacher_api_key. Without one the server starts on a
loopback --host only; any other host needs a key or --no_auth. Serves until Ctrl-C (or SIGTERM).
"""

from __future__ import annotations

import sys

from rlhfkit.cli.common import cli_main, run_cli
from rlhfkit.config.distill import ServeTeacherConfig

PROG = "rlhfkit.cli.serve_teacher"

main = cli_main(ServeTeacherConfig, PROG, __doc__, "rlhfkit.rl.teacher_server:run_teacher_server")


if __name__ == "__main__":
    sys.exit(run_cli(main, prog=PROG))
