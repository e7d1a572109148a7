"""`python -m rlhfkit.cli.serve_teacher --pretrain DIR --port N`: serve a distillation teacher over HTTP.

Students reach it with `--teacher_url http://HOST:N` (protocol in rlhfkit/rl/teacher_server.py). Binds 127.0.0.1
unless --host says otherwise. With a key (--api_key or RLHFKIT_TEACHER_API_KEY) every request needs
`Authorization: Bearer <key>`, which students send with --teacher_api_key. Without one the server starts on a
loopback --host only; any other host needs a key or --no_auth. Serves until Ctrl-C (or SIGTERM).
"""

from __future__ import annotations

import signal
import sys
import threading
from collections.abc import Sequence

from rlhfkit.cli.common import quiet_libraries, run_cli
from rlhfkit.config.base import parse_config
from rlhfkit.config.distill import ServeTeacherConfig

PROG = "rlhfkit.cli.serve_teacher"


def main(argv: Sequence[str] | None = None) -> int:
    quiet_libraries()
    cfg = parse_config(ServeTeacherConfig, argv, PROG, __doc__)
    cfg.check_inputs()  # the auth rule included: fails before the model loads
    api_key = cfg.resolved_api_key()
    from rlhfkit.models.loading import check_model_path
    from rlhfkit.rl.teacher_server import serve_teacher_model, served_teacher_spec

    path = check_model_path(cfg.pretrain, "--pretrain")  # named by this command's flag, before the process group
    spec = served_teacher_spec(path, cfg.bf16, cfg.temperature, cfg.batch_size)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda signum, frame: stop.set())
    server = serve_teacher_model(spec, cfg.host, cfg.port, api_key=api_key)
    if cfg.no_auth:  # (api_key is None then: --no_auth next to a key was refused)
        sys.stderr.write(f"{PROG}: warning: --no_auth: serving without a bearer token; anyone who can reach "
                         f"{cfg.host}:{server.server.server_port} can use the model\n")
    print(f"teacher server ready: {server.url} (temperature={cfg.temperature:g}, "
          f"auth={'bearer' if api_key else 'off'})", flush=True)
    try:
        while not stop.wait(0.5):  # until SIGTERM or Ctrl-C
            pass
    except KeyboardInterrupt:
        pass
    finally:
        server.stop()
    print("teacher server stopped", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(main, prog=PROG))
