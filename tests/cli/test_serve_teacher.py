"""`python -m rlhfkit.cli.serve_teacher` end to end, as a real process on 127.0.0.1: it prints its URL and auth
mode, a student's `HTTPTeacher` with the key (from RLHFKIT_TEACHER_API_KEY on the server's side, --teacher_api_key's
value on the student's) gets log-probs, one without it is refused, and SIGTERM stops it with exit code 0."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

import pytest
import torch

from rlhfkit.errors import UserError
from rlhfkit.rl.experience import experience_from_samples
from rlhfkit.rl.teacher import HTTPTeacher
from rlhfkit.rollout.engine import SampledSequence
from tests.helpers import REPO


def test_the_command_serves_a_keyed_teacher_to_a_student(demo_assets, tmp_path):
    log = tmp_path / "serve_teacher.log"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "RLHFKIT_TEACHER_API_KEY": "s3cret"}
    with log.open("w") as out:
        server = subprocess.Popen([sys.executable, "-m", "rlhfkit.cli.serve_teacher", "--pretrain",
                                   str(demo_assets.model_dir), "--port", "0", "--temperature", "0.8"],
                                  stdout=out, stderr=subprocess.STDOUT, env=env, cwd=REPO)
    try:
        deadline = time.monotonic() + 60
        while "ready" not in log.read_text() and server.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        ready = re.search(r"teacher server ready: (http://127\.0\.0\.1:\d+) \(temperature=0\.8, auth=bearer\)",
                          log.read_text())
        assert ready, log.read_text()[-2000:]
        exp = experience_from_samples([SampledSequence([1, 5, 6], [10, 11, 2], [0.0] * 3, "stop")], pad_id=0)
        scores = HTTPTeacher(ready.group(1), 2, timeout=30, api_key="s3cret").score(exp)
        assert scores["log_probs"].shape == (1, 3) and bool((scores["log_probs"] < 0).all())
        assert scores["topk_ids"].shape == (1, 3, 2) and torch.isfinite(scores["topk_log_probs"]).all()
        with pytest.raises(UserError, match="--teacher_api_key"):
            HTTPTeacher(ready.group(1), 0, timeout=30).fingerprint()
    finally:
        server.send_signal(signal.SIGTERM)
        code = server.wait(timeout=30)
    assert code == 0 and "teacher server stopped" in log.read_text()
