"""GGUF model sources (`rlhfkit.models.gguf`): a tiny llama GGUF written from the demo model converts once into a
cached Hugging Face directory with the same weights and tokenizer, SFT trains from it, the Transformers engine and
the trainer agree on its log-probs, and bad inputs stop with one line (exit 2)."""

from __future__ import annotations

import importlib.util
import json
import math

import pytest
import torch

from rlhfkit.cli.common import run_cli
from rlhfkit.cli.train_sft import main as sft_main
from rlhfkit.errors import UserError
from rlhfkit.models import gguf as gguf_source
from tests.helpers import error_lines

pytestmark = pytest.mark.skipif(importlib.util.find_spec("gguf") is None,
                                reason="the gguf package is not installed (pip install gguf)")


@pytest.fixture(scope="module")
def gguf_dir(demo_assets, tmp_path_factory):
    """A directory holding demo.gguf: the demo model and tokenizer as a float32 llama GGUF file."""
    from tests.gguf_writer import write_demo_gguf

    out = tmp_path_factory.mktemp("gguf")
    write_demo_gguf(demo_assets.model_dir, out / "demo.gguf")
    return out


@pytest.fixture(scope="module")
def shared_cache(tmp_path_factory):
    """One cache for the tests that only need some converted copy (they convert once between them)."""
    return tmp_path_factory.mktemp("shared_cache")


@pytest.fixture()
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("RLHFKIT_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


def sft_argv(assets, tmp_path, *model: str) -> list[str]:
    return [*model, "--dataset", str(assets.sft_train), "--input_key", "question", "--output_key", "response",
            "--input_template", "User: {}\nAssistant: ", "--train_batch_size", "4", "--micro_train_batch_size", "2",
            "--max_len", "48", "--max_samples", "8", "--max_epochs", "1", "--disable_progress_bar",
            "--save_path", str(tmp_path / "save"), "--ckpt_path", str(tmp_path / "ckpt")]


def one_error(capsys, argv) -> str:
    code = run_cli(sft_main, argv, prog="train_sft")
    err = error_lines(capsys.readouterr().err)
    assert code == 2, err
    assert len(err) == 1 and "Traceback" not in err[0], err
    return err[0]


def test_converts_once_with_the_same_weights_and_tokenizer(gguf_dir, demo_assets, cache, capsys, monkeypatch):
    from safetensors.torch import load_file
    from transformers import AutoTokenizer

    first = gguf_source.resolve_pretrain(str(gguf_dir / "demo.gguf"))
    assert "demo.gguf: converting the GGUF weights once" in capsys.readouterr().err
    assert first is not None and first.startswith(str(cache / "gguf"))
    ours, theirs = load_file(f"{first}/model.safetensors"), load_file(str(demo_assets.model_dir / "model.safetensors"))
    assert set(ours) == set(theirs)
    for name, tensor in theirs.items():
        torch.testing.assert_close(ours[name], tensor.float(), rtol=0, atol=0)
    assert "quantization_config" not in json.loads((cache / "gguf" / first.rsplit("/", 1)[1] / "config.json")
                                                   .read_text())
    text = "User: 12+34=?\nAssistant: 46"
    assert (AutoTokenizer.from_pretrained(first)(text).input_ids
            == AutoTokenizer.from_pretrained(demo_assets.model_dir)(text).input_ids)
    # The second use (the directory + --gguf_file spelling, same bytes) loads the cache and converts nothing.
    monkeypatch.setattr(gguf_source, "convert_gguf", lambda *a: pytest.fail("converted again"))
    assert gguf_source.resolve_pretrain(str(gguf_dir), "demo.gguf") == first
    assert "converted from GGUF before" in capsys.readouterr().err


def test_sft_two_steps_from_a_gguf_file(gguf_dir, demo_assets, cache, tmp_path, capsys):
    argv = sft_argv(demo_assets, tmp_path, "--pretrain", str(gguf_dir), "--gguf_file", "demo.gguf",
                    "--logging_steps", "1")
    code = run_cli(sft_main, argv, prog="train_sft")
    err = capsys.readouterr().err
    assert code == 0, err
    assert "demo.gguf: converting the GGUF weights once" in err
    assert (tmp_path / "save" / "config.json").is_file()
    rows = [json.loads(line) for line in (tmp_path / "save" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "train/loss" in r] == [1, 2]
    assert all(math.isfinite(r["train/loss"]) for r in rows if "train/loss" in r)
    assert (tmp_path / "save" / "model.safetensors").is_file() and (tmp_path / "save" / "tokenizer.json").is_file()


def test_engine_and_trainer_logprobs_agree_on_the_converted_model(gguf_dir, shared_cache, monkeypatch):
    monkeypatch.setenv("RLHFKIT_CACHE_DIR", str(shared_cache))
    from rlhfkit.models.loading import check_model_path, load_causal_lm, load_tokenizer
    from rlhfkit.models.policy import sequence_token_logprobs
    from rlhfkit.rollout.hf_engine import HFRolloutEngine

    path = check_model_path(str(gguf_dir / "demo.gguf"))  # every consumer's path check converts, too
    tok = load_tokenizer(path)
    engine = HFRolloutEngine.from_pretrained(path, tok)
    prompts = [[tok.bos_token_id, *tok(f"User: What is {a}+{b}?\nAssistant: ").input_ids] for a, b in ((3, 4), (12, 9))]
    samples = engine.generate(prompts, max_new_tokens=8, temperature=1.0, seed=0)
    trainer_model = load_causal_lm(path).eval()
    for s in samples:
        ids = torch.tensor([s.prompt_ids + s.response_ids])
        with torch.no_grad():
            lp = sequence_token_logprobs(trainer_model, {"input_ids": ids, "attention_mask": torch.ones_like(ids)})
        torch.testing.assert_close(torch.tensor(s.logprobs), lp[0, len(s.prompt_ids) - 1:], atol=1e-4, rtol=0)


def test_a_file_that_is_not_gguf_is_one_line(demo_assets, tmp_path, cache, capsys):
    fake = tmp_path / "model.gguf"
    fake.write_text("not a gguf file\n")
    line = one_error(capsys, sft_argv(demo_assets, tmp_path, "--pretrain", str(fake)))
    assert "model.gguf" in line and "not a GGUF file" in line


def test_gguf_file_naming_a_missing_file_is_one_line(gguf_dir, demo_assets, tmp_path, cache, capsys):
    line = one_error(capsys, sft_argv(demo_assets, tmp_path, "--pretrain", str(gguf_dir), "--gguf_file", "nope.gguf"))
    assert "--gguf_file nope.gguf" in line and "no such file" in line
    line = one_error(capsys, sft_argv(demo_assets, tmp_path, "--pretrain", str(gguf_dir / "demo.gguf"),
                                      "--gguf_file", "demo.gguf"))
    assert "--gguf_file demo.gguf" in line and "directory" in line


def test_missing_gguf_package_is_one_line_naming_it(gguf_dir, demo_assets, tmp_path, cache, capsys, monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "gguf" else real(name, *a))
    line = one_error(capsys, sft_argv(demo_assets, tmp_path, "--pretrain", str(gguf_dir / "demo.gguf")))
    assert "needs the gguf package" in line and "pip install gguf" in line


def test_every_rl_role_engine_and_batch_inference_get_the_converted_directory(gguf_dir, demo_assets, shared_cache,
                                                                              tmp_path, monkeypatch):
    monkeypatch.setenv("RLHFKIT_CACHE_DIR", str(shared_cache))
    from rlhfkit.cli.common import use_converted_gguf
    from rlhfkit.config import batch_inference
    from rlhfkit.config.base import parse_config
    from rlhfkit.config.rl import PPOConfig
    from rlhfkit.config.rl_specs import rl_specs
    from tests.cli.test_bad_inputs import base_argv

    argv = base_argv("train_ppo_ray", demo_assets, tmp_path)
    argv[argv.index("--pretrain") + 1] = str(gguf_dir / "demo.gguf")
    cfg = parse_config(PPOConfig, [*argv, "--init_kl_coef", "0.01", "--vllm_num_engines", "1"], "train_ppo_ray")
    use_converted_gguf(cfg)
    converted = gguf_source.resolve_pretrain(str(gguf_dir / "demo.gguf"))
    specs = rl_specs(cfg)
    assert specs.ref is not None and specs.engine.backend == "vllm"
    assert specs.actor.model.pretrain == specs.ref.path == specs.engine.model == converted
    inference = parse_config(batch_inference.BatchInferenceConfig,
                             ["--eval_task", "generate_vllm", "--pretrain", str(gguf_dir), "--gguf_file", "demo.gguf",
                              "--dataset", str(demo_assets.rl_train), "--input_key", "prompt",
                              "--output_path", str(tmp_path / "out.jsonl")], "batch_inference")
    use_converted_gguf(inference)
    assert batch_inference.engine_spec(inference).model == converted


@pytest.mark.parametrize("cli", ["train_rm", "train_dpo", "train_kto", "train_ppo", "train_ppo_ray"])
def test_every_trainer_takes_a_gguf_file(cli, gguf_dir, demo_assets, shared_cache, tmp_path, capsys, monkeypatch):
    """Every trainer's entry point converts the file and plans on the converted model (--dry_run: no training)."""
    import importlib

    monkeypatch.setenv("RLHFKIT_CACHE_DIR", str(shared_cache))
    from tests.cli.test_bad_inputs import base_argv

    argv = base_argv(cli, demo_assets, tmp_path)
    argv[argv.index("--pretrain") + 1] = str(gguf_dir / "demo.gguf")
    main = importlib.import_module(f"rlhfkit.cli.{cli}").main
    code = run_cli(main, [*argv, "--dry_run"], prog=cli)
    err = capsys.readouterr().err
    assert code == 0, err
    assert "demo.gguf: converting the GGUF weights once" in err or "demo.gguf: converted from GGUF before" in err


def test_other_local_ranks_wait_for_the_conversion(gguf_dir, cache, monkeypatch):
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("RLHFKIT_GGUF_WAIT_S", "0.2")
    monkeypatch.setattr(gguf_source, "convert_gguf", lambda *a: pytest.fail("only local rank 0 converts"))
    with pytest.raises(UserError, match="waited 0 s for local rank 0 to convert it"):
        gguf_source.resolve_pretrain(str(gguf_dir / "demo.gguf"))
    target = gguf_source.converted_dir(gguf_dir / "demo.gguf")
    target.mkdir(parents=True)
    (target / gguf_source.MARKER).write_text("{}\n")  # what local rank 0 writes last
    assert gguf_source.resolve_pretrain(str(gguf_dir / "demo.gguf")) == str(target)
