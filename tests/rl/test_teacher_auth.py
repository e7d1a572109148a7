"""The distillation teacher server's bearer token: a served teacher with a key answers 401 (JSON) to a request
without it or with a wrong one, and the student (`HTTPTeacher`) stops with one line naming --teacher_api_key; the
right key gives exactly the log-probs of a server without auth. Also the key rules of serve_teacher (a loopback host
may serve without a key, any other host needs one or --no_auth) and of --teacher_api_key, without starting a
process (the CLI subprocess test is tests/cli/test_serve_teacher.py)."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest
import torch

from rlhfkit.cli import serve_teacher
from rlhfkit.cli.common import run_cli
from rlhfkit.config.base import parse_config
from rlhfkit.config.distill import TEACHER_KEY_ENV, ServeTeacherConfig
from rlhfkit.config.rl import PPOConfig
from rlhfkit.config.serving import authorized, is_loopback
from rlhfkit.errors import UserError
from rlhfkit.rl.experience import experience_from_samples
from rlhfkit.rl.teacher import HTTPTeacher, teacher_api_key
from rlhfkit.rl.teacher_server import TeacherServer, serve_teacher_model, served_teacher_spec
from rlhfkit.rollout.engine import SampledSequence
from tests.helpers import error_lines


def experience():
    return experience_from_samples([SampledSequence([1, 5, 6, 7], [10, 11, 2], [0.0] * 3, "stop"),
                                    SampledSequence([1, 5], [12, 13, 14, 15], [0.0] * 4, "length")], pad_id=0)


def status_of(url: str, headers: dict[str, str]) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=10) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_a_keyed_teacher_refuses_other_tokens_and_serves_the_key_the_same_log_probs(demo_assets, world_of_one):
    spec = served_teacher_spec(str(demo_assets.model_dir), bf16=False, temperature=0.8, batch_size=2)
    keyed, open_ = serve_teacher_model(spec, api_key="s3cret"), serve_teacher_model(spec)
    exp = experience()
    try:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "Basic s3cret"}):
            status, body = status_of(keyed.url + "/info", headers)
            assert status == 401 and "bearer token" in body["error"]
        assert status_of(keyed.url + "/info", {"Authorization": "Bearer s3cret"})[0] == 200
        with pytest.raises(UserError, match="requires a bearer token.*--teacher_api_key") as missing:
            HTTPTeacher(keyed.url, 0, timeout=10).score(exp)
        with pytest.raises(UserError, match="refused the bearer token.*--teacher_api_key") as wrong:
            HTTPTeacher(keyed.url, 0, timeout=10, api_key="wrong").fingerprint()
        assert "\n" not in str(missing.value) + str(wrong.value)
        for topk in (0, 3):
            served = HTTPTeacher(keyed.url, topk, timeout=10, api_key="s3cret").score(exp)
            plain = HTTPTeacher(open_.url, topk, timeout=10).score(exp)
            assert served.keys() == plain.keys() and served["log_probs"].shape == (2, 4)
            assert all(torch.equal(served[k], plain[k]) for k in served)
    finally:
        keyed.stop()
        open_.stop()


def test_a_teacher_without_a_key_serves_as_before():
    server = TeacherServer(lambda exp, k: {}, fingerprint="f").start()
    try:
        assert status_of(server.url + "/info", {}) == (200, {"tokenizer": "f"})
    finally:
        server.stop()


def test_the_bearer_check():
    assert authorized(None, None) and authorized("x", "")
    assert authorized("Bearer k ", "k") and authorized("bearer k", "k")
    assert not authorized(None, "k") and not authorized("Bearer kk", "k") and not authorized("Basic k", "k")
    assert [is_loopback(h) for h in ("127.0.0.1", "127.1.2.3", "::1", "localhost", "0.0.0.0", "10.0.0.1",
                                     "teacher-host")] == [True, True, True, True, False, False, False]


@pytest.mark.parametrize("flags, env, outcome", [
    ([], None, None),  # loopback: serves without a key
    (["--host", "0.0.0.0", "--api_key", "k"], None, "k"),
    (["--host", "0.0.0.0", "--api_key", ""], "from-env", "from-env"),  # an empty flag keeps the env key
    (["--host", "0.0.0.0", "--no_auth"], None, None),
    (["--host", "0.0.0.0"], None, "--host 0.0.0.0 .* needs a bearer token: set --api_key or RLHFKIT_TEACHER"),
    (["--no_auth", "--api_key", "k"], None, "--no_auth contradicts the key in --api_key"),
    (["--no_auth"], "from-env", "--no_auth contradicts the key in RLHFKIT_TEACHER_API_KEY"),
])
def test_serve_teacher_key_rules(monkeypatch, flags, env, outcome):
    if env is None:
        monkeypatch.delenv(TEACHER_KEY_ENV, raising=False)
    else:
        monkeypatch.setenv(TEACHER_KEY_ENV, env)
    cfg = parse_config(ServeTeacherConfig, ["--pretrain", "m", *flags], "serve_teacher")
    if outcome is None or " " not in outcome:
        assert cfg.resolved_api_key() == outcome
    else:
        with pytest.raises(UserError, match=outcome):
            cfg.check_inputs()


@pytest.mark.parametrize("flags, needle", [
    (["--host", "0.0.0.0"], "needs a bearer token"),
    (["--no_auth", "--api_key", "k"], "--no_auth contradicts"),
    (["--port", "70000"], "--port 70000 is not a TCP port"),
])
def test_serve_teacher_refuses_with_one_line_and_exit_2_before_loading(monkeypatch, capsys, flags, needle):
    monkeypatch.delenv(TEACHER_KEY_ENV, raising=False)
    code = run_cli(serve_teacher.main, ["--pretrain", "/no/such/model", *flags], prog="serve_teacher")
    err = error_lines(capsys.readouterr().err)
    assert code == 2 and len(err) == 1 and needle in err[0], err


def test_the_students_key_comes_from_the_flag_else_the_environment(demo_assets, monkeypatch):
    def cfg(*flags: str) -> PPOConfig:
        return parse_config(PPOConfig, ["--pretrain", str(demo_assets.model_dir), "--zero_stage", "0", *flags], "t")

    monkeypatch.setenv(TEACHER_KEY_ENV, "from-env")
    assert teacher_api_key(cfg("--teacher_url", "http://127.0.0.1:1")) == "from-env"
    assert teacher_api_key(cfg("--teacher_url", "http://127.0.0.1:1", "--teacher_api_key", "k")) == "k"
    with pytest.raises(UserError, match="--teacher_api_key is the key of a served teacher: add --teacher_url"):
        cfg("--teacher_api_key", "k")


def test_a_run_records_no_key(demo_assets):
    import dataclasses

    from rlhfkit.config.serving import HIDDEN, without_keys

    cfg = parse_config(PPOConfig, ["--pretrain", str(demo_assets.model_dir), "--zero_stage", "0", "--teacher_url",
                                   "http://127.0.0.1:1", "--teacher_api_key", "s3cret"], "t")
    recorded = without_keys(dataclasses.asdict(cfg))
    assert "s3cret" not in json.dumps(recorded) and recorded["distill"]["teacher_api_key"] == HIDDEN
    assert recorded["distill"]["teacher_url"] == "http://127.0.0.1:1" and cfg.distill.teacher_api_key == "s3cret"
    assert without_keys({"distill": {"teacher_api_key": None}}) == {"distill": {"teacher_api_key": None}}


def test_a_run_records_no_wandb_api_key():
    """OpenRLHF's --use_wandb takes the W&B API key itself; its other values (offline, true) are no secret."""
    from rlhfkit.config.serving import HIDDEN, without_keys

    for value, recorded in (("0123456789abcdef0123456789abcdef01234567", HIDDEN), ("offline", "offline"),
                            ("True", "True"), (None, None)):
        assert without_keys({"logging": {"use_wandb": value}}) == {"logging": {"use_wandb": recorded}}
