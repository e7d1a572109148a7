"""On-policy distillation without a training run: the HTTP teacher gives the local teacher's loss (to 1e-6), a
teacher with another tokenizer stops with one line, the flags' rules and the teacher's placement."""

from __future__ import annotations

import shutil

import pytest
import torch

from rlhfkit.algorithms.distill_loss import distillation_loss
from rlhfkit.algorithms.logprobs import token_logprobs
from rlhfkit.config.base import parse_config
from rlhfkit.config.rl import PPOConfig
from rlhfkit.config.rl_specs import rl_specs, teacher_spec
from rlhfkit.errors import UserError
from rlhfkit.rl.experience import experience_from_samples
from rlhfkit.rl.role_forward import action_logits
from rlhfkit.rl.teacher import HTTPTeacher, TeacherRole, check_teacher_tokenizer
from rlhfkit.rl.teacher_server import TeacherServer, serve_teacher_model
from rlhfkit.rollout.engine import SampledSequence


@pytest.fixture(scope="module")
def teacher_dir(demo_assets, tmp_path_factory):
    """The demo model with perturbed weights (so teacher and student differ) and the demo tokenizer."""
    from transformers import AutoModelForCausalLM

    out = tmp_path_factory.mktemp("teacher")
    shutil.copytree(demo_assets.model_dir, out, dirs_exist_ok=True)
    model = AutoModelForCausalLM.from_pretrained(demo_assets.model_dir)
    torch.manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    model.save_pretrained(out)
    return out


def config(assets, *extra: str) -> PPOConfig:
    return parse_config(PPOConfig, [
        "--pretrain", str(assets.model_dir), "--advantage_estimator", "group_norm", "--n_samples_per_prompt", "2",
        "--rollout_batch_size", "2", "--micro_rollout_batch_size", "2", "--train_batch_size", "4",
        "--micro_train_batch_size", "2", "--temperature", "0.8",
        *([] if "--backend" in extra else ["--zero_stage", "0"]), *extra], "test")


def experience():
    """Three samples; the third is an agent episode whose tokens 2-3 are environment feedback (mask 0)."""
    exp = experience_from_samples([
        SampledSequence([1, 5, 6, 7], [10, 11, 2], [0.0] * 3, "stop"),
        SampledSequence([1, 5], [12, 13, 14, 15, 16], [0.0] * 5, "length"),
        SampledSequence([1, 5, 6], [20, 21, 22, 23, 24], [0.0] * 5, "stop", action_mask=[1, 1, 0, 0, 1]),
    ], pad_id=0)
    return exp


@pytest.mark.parametrize("loss", ["reverse_kl", "topk_forward_kl"])
def test_http_teacher_gives_the_local_teachers_loss(demo_assets, teacher_dir, world_of_one, loss):
    from transformers import AutoModelForCausalLM

    cfg = config(demo_assets, "--teacher_pretrain", str(teacher_dir), "--distill_loss", loss, "--distill_topk", "5")
    spec = teacher_spec(cfg)
    exp = experience()
    local = TeacherRole(spec).score(exp)
    server = serve_teacher_model(spec)
    try:
        remote = HTTPTeacher(server.url, spec.topk, timeout=30).score(exp)
    finally:
        server.stop()
    assert set(local) == set(remote) == ({"log_probs"} | ({"topk_ids", "topk_log_probs"} if spec.topk else set()))
    student = AutoModelForCausalLM.from_pretrained(demo_assets.model_dir)
    logits = action_logits(student, exp) / 0.8
    logp = token_logprobs(logits, exp.action_tokens())
    losses = []
    for scores in (local, remote):
        value, info = distillation_loss(loss, logits, logp, exp.action_mask, teacher_logp=scores["log_probs"],
                                        topk_ids=scores.get("topk_ids"), topk_logp=scores.get("topk_log_probs"))
        losses.append(float(value.detach()))
    assert losses[0] > 1e-3  # the teacher differs from the student
    print(f"{loss}: local {losses[0]:.9f}, http {losses[1]:.9f}, |diff| {abs(losses[0] - losses[1]):.2e}")
    assert abs(losses[0] - losses[1]) <= 1e-6, losses
    mask = exp.action_mask
    torch.testing.assert_close(remote["log_probs"][mask], local["log_probs"][mask], atol=1e-6, rtol=0)


def test_teacher_is_sharded_on_fsdp2_and_scores_as_the_whole_model(demo_assets, teacher_dir, world_of_one):
    """--backend fsdp2 shards the teacher as it shards the reference (`prepare_eval(shard_fsdp2=True)`), and the
    sharded teacher's scores are the whole model's."""
    from torch.distributed.tensor import DTensor

    flags = ("--teacher_pretrain", str(teacher_dir), "--distill_loss", "topk_forward_kl", "--distill_topk", "5",
             "--param_dtype", "fp32")
    whole = TeacherRole(teacher_spec(config(demo_assets, *flags)))
    sharded = TeacherRole(teacher_spec(config(demo_assets, *flags, "--backend", "fsdp2")))
    assert all(isinstance(p, DTensor) for p in sharded.model.parameters())
    assert not any(isinstance(p, DTensor) for p in whole.model.parameters())
    exp = experience()
    expected, got = whole.score(exp), sharded.score(exp)
    assert got.keys() == expected.keys()
    for key in expected:
        torch.testing.assert_close(got[key], expected[key], rtol=1e-5, atol=1e-6)


@pytest.fixture(scope="module")
def other_tokenizer_teacher(teacher_dir, tmp_path_factory):
    """The teacher with one token more in its tokenizer."""
    from transformers import AutoTokenizer

    other = tmp_path_factory.mktemp("other_teacher")
    shutil.copytree(teacher_dir, other, dirs_exist_ok=True)
    tokenizer = AutoTokenizer.from_pretrained(other)
    tokenizer.add_tokens(["<not-in-the-student>"])
    tokenizer.save_pretrained(other)
    return other


def test_teacher_with_another_tokenizer_is_refused(demo_assets, teacher_dir, other_tokenizer_teacher):
    from transformers import AutoTokenizer

    student = AutoTokenizer.from_pretrained(demo_assets.model_dir)
    check_teacher_tokenizer(str(teacher_dir), None, student)  # the same tokenizer passes
    with pytest.raises(UserError) as local:
        check_teacher_tokenizer(str(other_tokenizer_teacher), None, student)
    server = TeacherServer(lambda exp, k: {}, fingerprint="another tokenizer").start()
    try:
        with pytest.raises(UserError) as remote:
            check_teacher_tokenizer(None, server.url, student)
    finally:
        server.stop()
    for error in (local.value, remote.value):
        assert "tokenizer differs from the actor's" in str(error) and "\n" not in str(error)


def test_served_teacher_at_another_temperature_is_refused(demo_assets):
    """serve_teacher says its temperature in GET /info; a student sampling at another --temperature stops with one
    line naming both; a server that names none (another implementation of the protocol) is not checked."""
    from transformers import AutoTokenizer

    from rlhfkit.rl.teacher import tokenizer_fingerprint

    student = AutoTokenizer.from_pretrained(demo_assets.model_dir)
    fingerprint = tokenizer_fingerprint(student)
    warm = TeacherServer(lambda exp, k: {}, fingerprint=fingerprint, temperature=0.7).start()
    silent = TeacherServer(lambda exp, k: {}, fingerprint=fingerprint).start()
    try:
        assert HTTPTeacher(warm.url, 0, 10).info() == {"tokenizer": fingerprint, "temperature": 0.7}
        check_teacher_tokenizer(None, warm.url, student, temperature=0.7)
        with pytest.raises(UserError) as e:
            check_teacher_tokenizer(None, warm.url, student, temperature=1.0)
        check_teacher_tokenizer(None, silent.url, student, temperature=1.0)
    finally:
        warm.stop()
        silent.stop()
    message = str(e.value)
    assert "temperature 0.7" in message and "--temperature 1" in message and "\n" not in message
    assert "restart serve_teacher with --temperature 1" in message


@pytest.mark.parametrize("cli", ["train_ppo", "train_ppo_ray"])
def test_cli_stops_with_one_line_before_the_models_or_ray(cli, demo_assets, other_tokenizer_teacher, tmp_path,
                                                        capsys, monkeypatch):
    import importlib

    import rlhfkit.rl.ray_run as ray_run
    from rlhfkit.cli.common import run_cli
    from rlhfkit.rl.roles import ActorRole

    def too_far(*args, **kwargs):
        raise AssertionError("the run went past the tokenizer check")

    monkeypatch.chdir(tmp_path)  # the default --ckpt_path is relative: another run's checkpoints there would refuse
    monkeypatch.setattr(ActorRole, "__init__", too_far)  # train_ppo's first model
    monkeypatch.setattr(ray_run, "connect_ray", too_far)  # train_ppo_ray checks before Ray starts
    module = importlib.import_module(f"rlhfkit.cli.{cli}")
    argv = ["--pretrain", str(demo_assets.model_dir), "--prompt_data", str(demo_assets.rl_train),
            "--input_key", "prompt", "--remote_rm_url", str(tmp_path / "reward.py"), "--advantage_estimator",
            "group_norm", "--n_samples_per_prompt", "2", "--rollout_batch_size", "2", "--train_batch_size", "4",
            "--micro_train_batch_size", "2", "--micro_rollout_batch_size", "2", "--save_path", str(tmp_path / "out"),
            "--teacher_pretrain", str(other_tokenizer_teacher), "--colocate_all_models"]
    (tmp_path / "reward.py").write_text("def reward_func(queries, prompts, labels):\n    return [0.0] * len(queries)\n")
    capsys.readouterr()
    code = run_cli(module.main, argv, prog=cli)
    err = [line for line in capsys.readouterr().err.strip().splitlines() if "error" in line]
    assert code == 2 and len(err) == 1, err
    assert "--teacher_pretrain" in err[0] and "tokenizer differs from the actor's" in err[0]


def test_teacher_server_refuses_bad_requests():
    import json
    import urllib.error
    import urllib.request

    server = TeacherServer(lambda exp, k: {}, fingerprint="f").start()
    try:
        for body in ({"input_ids": [[1, 2]], "prompt_lengths": [2]}, {"input_ids": [], "prompt_lengths": []},
                     {"input_ids": [[1, 2]], "prompt_lengths": [1], "topk": -1}):
            request = urllib.request.Request(server.url + "/logprobs", data=json.dumps(body).encode())
            with pytest.raises(urllib.error.HTTPError) as e:
                urllib.request.urlopen(request, timeout=10)
            assert e.value.code == 400
    finally:
        server.stop()


@pytest.mark.parametrize("flags, needle", [
    (["--distill_only"], "needs a teacher"),
    (["--distill_loss", "topk_forward_kl"], "needs a teacher"),
    (["--teacher_pretrain", "x", "--teacher_url", "http://127.0.0.1:1"], "not both"),
    (["--teacher_url", "127.0.0.1:8000"], "not an http(s) URL"),
    (["--teacher_url", "http://127.0.0.1:1", "--distill_topk", "0"], "--distill_topk must be >= 1"),
])
def test_distillation_flag_rules(demo_assets, flags, needle):
    with pytest.raises(UserError, match=needle.replace("(", r"\(").replace(")", r"\)")):
        config(demo_assets, *flags)


def test_teacher_is_placed_like_the_reference(demo_assets):
    specs = rl_specs(config(demo_assets, "--teacher_pretrain", "t", "--colocate_actor_ref",
                            "--teacher_num_gpus_per_node", "0"))
    assert dict(specs.placement.role_ranks)["teacher"] == 1  # a colocated role given 0 devices gets the actor's
    assert specs.teacher is not None and specs.teacher.topk == 0 and specs.actor.distill_loss == "reverse_kl"
    over_http = rl_specs(config(demo_assets, "--teacher_url", "http://127.0.0.1:1", "--distill_loss",
                                "topk_forward_kl", "--distill_topk", "3"))
    assert over_http.teacher is None and "teacher" not in dict(over_http.placement.role_ranks)
    assert over_http.actor.distill_loss == "topk_forward_kl"
    plain = rl_specs(config(demo_assets))
    assert plain.teacher is None and plain.actor.distill_loss is None
