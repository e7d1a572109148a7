"""Hostile input, one policy: every CLI refuses a bad data file, model, flag or reward file before heavy work with
one line on stderr that names the problem (file, record, field) and how to fix it, exit code 2, no traceback.

Most cases call the CLI's `main` in-process through `run_cli` (the failure comes before any model loads or any
process group is joined, so nothing is left behind); two run the real console entry point as a subprocess to prove
the process's own exit code and stderr.
"""

from __future__ import annotations

import importlib
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from rlhfkit.cli.common import run_cli
from tests.helpers import REPO, error_lines


@dataclass(frozen=True)
class Case:
    id: str
    cli: str  # module under rlhfkit.cli
    argv: Callable[[object, Path], list[str]]  # (demo assets, tmp dir) -> extra argv appended to the base
    expect: tuple[str, ...]  # substrings the one error line must contain


def write(path: Path, text: str | bytes) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(text if isinstance(text, bytes) else text.encode("utf-8"))
    return str(path)


def jsonl(path: Path, rows: list) -> str:
    return write(path, "".join(json.dumps(r) + "\n" for r in rows))


def sft_row(q: str = "What is 1+1?", r: str = "2") -> dict:
    return {"question": q, "response": r}


def pair(prompt: str = "What is 1+1?", chosen: object = "2", rejected: object = "3") -> dict:
    return {"prompt": prompt, "chosen": chosen, "rejected": rejected}


def chat(*messages: dict) -> dict:
    return {"messages": list(messages)}


def base_argv(cli: str, a, tmp: Path) -> list[str]:
    """A valid command for each CLI on the demo assets; a case appends what makes it bad (argparse: last wins)."""
    out = ["--save_path", str(tmp / "save"), "--ckpt_path", str(tmp / "ckpt")]
    common = ["--pretrain", str(a.model_dir), "--max_len", "64", "--train_batch_size", "8",
              "--micro_train_batch_size", "2", "--max_samples", "64", "--disable_progress_bar", *out]
    if cli == "train_sft":
        return [*common, "--dataset", str(a.sft_train), "--input_key", "question", "--output_key", "response"]
    if cli in ("train_rm", "train_dpo"):
        return [*common, "--dataset", str(a.pref_train), "--prompt_key", "prompt", "--input_template",
                "User: {}\nAssistant: "]
    if cli == "train_kto":
        return [*common, "--dataset", str(a.kto_train), "--input_key", "prompt", "--output_key", "completion"]
    if cli in ("train_ppo", "train_ppo_ray"):
        return ["--pretrain", str(a.model_dir), "--prompt_data", str(a.rl_train), "--input_key", "prompt",
                "--label_key", "answer", "--remote_rm_url", str(REPO / "examples" / "reward_func.py"),
                "--advantage_estimator", "group_norm", "--n_samples_per_prompt", "2", "--rollout_batch_size", "4",
                "--train_batch_size", "8", "--micro_train_batch_size", "2", "--micro_rollout_batch_size", "4",
                "--init_kl_coef", "0", "--max_samples", "16", "--prompt_max_len", "32", "--generate_max_len", "8",
                "--disable_progress_bar", *out]
    if cli == "serve_rm":
        return ["--reward_pretrain", str(a.model_dir), "--port", "0", "--no_auth"]
    raise AssertionError(cli)


def no_template_model(a, tmp: Path) -> str:
    """A copy of the demo model whose tokenizer has no chat template."""
    dst = tmp / "no_template"
    shutil.copytree(a.model_dir, dst)
    (dst / "chat_template.jinja").unlink(missing_ok=True)
    cfg_path = dst / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg.pop("chat_template", None)
    cfg_path.write_text(json.dumps(cfg))
    return str(dst)


def reward_file(tmp: Path, source: str) -> list[str]:
    return ["--remote_rm_url", write(tmp / "my_reward.py", source)]


def parquet(path: Path, columns: dict) -> str:
    import pyarrow as pa
    import pyarrow.parquet as pq

    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table(columns), str(path))
    return str(path)


D = "--dataset"
CHAT = ["--input_key", "messages", "--apply_chat_template", "--multiturn"]
CASES = [
    # -- data files ---------------------------------------------------------------------------------------------
    Case("malformed_json_line_in_the_middle", "train_sft",
         lambda a, t: [D, write(t / "d.jsonl", json.dumps(sft_row()) + "\n{\"question\": \"x\", \n"
                                + json.dumps(sft_row()) + "\n")],
         ("d.jsonl", "line 2", "not valid JSON")),
    Case("invalid_utf8_bytes", "train_sft",
         lambda a, t: [D, write(t / "d.jsonl", b'{"question": "caf\xe9", "response": "2"}\n')],
         ("d.jsonl", "not UTF-8")),
    Case("bad_type_number_as_prompt", "train_sft",
         lambda a, t: [D, jsonl(t / "d.jsonl", [sft_row(), {"question": 5, "response": "2"}])],
         ("d.jsonl", "record 2", "question")),
    Case("bad_type_list_as_response", "train_sft",
         lambda a, t: [D, jsonl(t / "d.jsonl", [sft_row(), {"question": "q", "response": ["2"]}])],
         ("d.jsonl", "record 2", "response")),
    Case("missing_response_field", "train_sft",
         lambda a, t: [D, jsonl(t / "d.jsonl", [sft_row(), sft_row(), {"question": "q"}])],
         ("d.jsonl", "record 3", "response")),
    Case("missing_null_prompt_field", "train_sft",
         lambda a, t: [D, jsonl(t / "d.jsonl", [{"question": None, "response": "2"}])],
         ("d.jsonl", "record 1", "question")),
    Case("invalid_empty_response", "train_sft",
         lambda a, t: [D, jsonl(t / "d.jsonl", [sft_row(), sft_row("q", "")])],
         ("d.jsonl", "record 2", "response")),
    Case("bad_record_not_an_object", "train_sft",
         lambda a, t: [D, write(t / "d.jsonl", json.dumps(sft_row()) + "\n[1, 2]\n")],
         ("d.jsonl", "record 2", "not an object")),
    Case("bad_chat_role", "train_sft",
         lambda a, t: [*CHAT, D, jsonl(t / "d.jsonl", [chat({"role": "user", "content": "hi"},
                                                            {"role": "wizard", "content": "2"})])],
         ("d.jsonl", "record 1", "role", "wizard")),
    Case("missing_chat_content", "train_sft",
         lambda a, t: [*CHAT, D, jsonl(t / "d.jsonl", [chat({"role": "user", "content": "hi"},
                                                            {"role": "assistant"})])],
         ("d.jsonl", "record 1", "content")),
    Case("bad_chat_messages_not_a_list", "train_sft",
         lambda a, t: [*CHAT, D, jsonl(t / "d.jsonl", [{"messages": "hello"}])],
         ("d.jsonl", "record 1", "messages")),
    Case("bad_oversized_5mb_record", "train_sft",
         lambda a, t: [D, jsonl(t / "d.jsonl", [sft_row(), sft_row("q " * 2_600_000, "2")])],
         ("d.jsonl", "record 2", "MB")),
    Case("invalid_empty_file", "train_sft", lambda a, t: [D, write(t / "d.jsonl", "")],
         ("d.jsonl", "no records")),
    Case("missing_data_files_in_directory", "train_sft",
         lambda a, t: [D, str(Path(write(t / "data" / "notes.txt", "hello")).parent)],
         ("data", "no data files")),
    Case("bad_parquet_columns", "train_sft",
         lambda a, t: [D, parquet(t / "d.parquet", {"q": ["a", "b"], "a": ["1", "2"]})],
         ("d.parquet", "record 1", "question")),
    Case("missing_dataset_path", "train_sft", lambda a, t: [D, str(t / "nope.jsonl")],
         ("nope.jsonl", "no such file")),
    Case("invalid_file_type", "train_sft", lambda a, t: [D, write(t / "d.txt", "hello\n")],
         ("d.txt", "unsupported file type")),
    Case("invalid_json_top_level_number", "train_sft", lambda a, t: [D, write(t / "d.json", "42")],
         ("d.json", "expected a JSON list")),
    Case("bad_dataset_probs_count", "train_sft",
         lambda a, t: [D, f"{a.sft_train},{a.sft_eval}", "--dataset_probs", "0.5,0.3,0.2"],
         ("--dataset_probs", "one probability per dataset")),
    Case("bad_split_of_a_single_file", "train_sft", lambda a, t: [D, f"{a.sft_train}@test"],
         ("@test", "no splits")),
    Case("invalid_chosen_identical_to_rejected", "train_dpo",
         lambda a, t: [D, jsonl(t / "p.jsonl", [pair(), pair(chosen="4", rejected="4")])],
         ("p.jsonl", "record 2", "identical")),
    Case("missing_rejected_field", "train_rm",
         lambda a, t: [D, jsonl(t / "p.jsonl", [pair(), {"prompt": "q", "chosen": "2"}])],
         ("p.jsonl", "record 2", "rejected")),
    Case("bad_type_chosen_number", "train_dpo",
         lambda a, t: [D, jsonl(t / "p.jsonl", [pair(chosen=7)])],
         ("p.jsonl", "record 1", "chosen")),
    Case("invalid_kto_label", "train_kto",
         lambda a, t: [D, jsonl(t / "k.jsonl", [{"prompt": "q", "completion": "2", "label": True},
                                                {"prompt": "q", "completion": "3", "label": "maybe"}])],
         ("k.jsonl", "record 2", "label")),
    Case("missing_prompt_field_in_rl_data", "train_ppo",
         lambda a, t: ["--prompt_data", jsonl(t / "r.jsonl", [{"prompt": "q", "answer": "1"}] * 3
                                              + [{"question": "q", "answer": "1"}])],
         ("r.jsonl", "record 4", "prompt")),
    # -- models and tokenizers ----------------------------------------------------------------------------------
    Case("bad_pretrain_is_a_file", "train_sft",
         lambda a, t: ["--pretrain", str(a.model_dir / "config.json")], ("--pretrain", "config.json", "is a file")),
    Case("missing_pretrain_directory", "train_sft", lambda a, t: ["--pretrain", str(t / "no_model")],
         ("--pretrain", "no_model")),
    Case("bad_pretrain_empty_directory", "train_dpo", lambda a, t: ["--pretrain", str(Path(write(
        t / "empty_model" / "README.md", "nothing here")).parent)], ("--pretrain", "empty_model")),
    Case("missing_chat_template", "train_sft",
         lambda a, t: [*CHAT, "--pretrain", no_template_model(a, t), D,
                       jsonl(t / "d.jsonl", [chat({"role": "user", "content": "hi"},
                                                  {"role": "assistant", "content": "2"})])],
         ("chat template", "--tokenizer_chat_template")),
    Case("bad_reward_pretrain_is_a_file", "serve_rm",
         lambda a, t: ["--reward_pretrain", str(a.model_dir / "config.json")], ("--reward_pretrain", "config.json")),
    # -- flags: out of range, contradictions, wrong types ---------------------------------------------------------
    Case("invalid_logging_steps_zero", "train_sft", lambda a, t: ["--logging_steps", "0"], ("--logging_steps",)),
    Case("invalid_learning_rate_nan", "train_sft", lambda a, t: ["--learning_rate", "nan"], ("--learning_rate",)),
    Case("invalid_learning_rate_negative", "train_sft", lambda a, t: ["--learning_rate", "-1e-3"],
         ("--learning_rate", "-0.001", "positive")),
    Case("invalid_learning_rate_inf", "train_rm", lambda a, t: ["--learning_rate", "inf"], ("--learning_rate",)),
    Case("invalid_adam_betas_out_of_range", "train_sft", lambda a, t: ["--adam_betas", "1.5", "0.9"],
         ("--adam_betas", "[0, 1)")),
    Case("invalid_adam_betas_count", "train_dpo", lambda a, t: ["--adam_betas", "0.9"], ("--adam_betas", "two")),
    Case("invalid_lr_warmup_ratio", "train_sft", lambda a, t: ["--lr_warmup_ratio", "1.5"], ("--lr_warmup_ratio",)),
    Case("invalid_max_norm_negative", "train_kto", lambda a, t: ["--max_norm", "-1"], ("--max_norm",)),
    Case("invalid_weight_decay_negative", "train_sft", lambda a, t: ["--l2", "-0.1"], ("--l2",)),
    Case("invalid_max_len_zero", "train_sft", lambda a, t: ["--max_len", "0"], ("--max_len",)),
    Case("invalid_eval_steps_zero", "train_sft", lambda a, t: ["--eval_steps", "0"], ("--eval_steps",)),
    Case("invalid_save_steps_zero", "train_rm", lambda a, t: ["--save_steps", "0"], ("--save_steps",)),
    Case("invalid_max_ckpt_num_zero", "train_sft", lambda a, t: ["--max_ckpt_num", "0"], ("--max_ckpt_num",)),
    Case("invalid_max_samples_zero", "train_sft", lambda a, t: ["--max_samples", "0"], ("--max_samples",)),
    Case("invalid_lora_rank_negative", "train_sft", lambda a, t: ["--lora_rank", "-4"], ("--lora_rank",)),
    Case("bad_batch_not_divisible", "train_sft", lambda a, t: ["--train_batch_size", "6",
                                                               "--micro_train_batch_size", "4"],
         ("--train_batch_size 6", "--micro_train_batch_size 4")),
    Case("bad_flash_attn_contradicts_eager", "train_sft",
         lambda a, t: ["--flash_attn", "--attn_implementation", "eager"], ("--flash_attn", "--attn_implementation")),
    Case("invalid_zero_stage_choice", "train_sft", lambda a, t: ["--zero_stage", "5"], ("--zero_stage", "5")),
    Case("invalid_int_flag_text", "train_dpo", lambda a, t: ["--max_epochs", "two"], ("--max_epochs", "two")),
    Case("invalid_dpo_beta_negative", "train_dpo", lambda a, t: ["--beta", "-0.1"], ("--beta",)),
    Case("invalid_serve_rm_port", "serve_rm", lambda a, t: ["--port", "70000"], ("--port 70000",)),
    Case("invalid_actor_learning_rate_negative", "train_ppo", lambda a, t: ["--actor_learning_rate", "-1e-6"],
         ("--actor_learning_rate",)),
    Case("invalid_kl_coef_negative", "train_ppo", lambda a, t: ["--init_kl_coef", "-0.1"], ("--init_kl_coef",)),
    Case("bad_group_estimator_single_sample", "train_ppo_ray",
         lambda a, t: ["--n_samples_per_prompt", "1", "--train_batch_size", "4"],
         ("group_norm", "--n_samples_per_prompt")),
    Case("invalid_temperature_zero", "train_ppo", lambda a, t: ["--temperature", "0"], ("--temperature",)),
    Case("invalid_top_p", "train_ppo", lambda a, t: ["--top_p", "1.5"], ("--top_p",)),
    # -- reward files -------------------------------------------------------------------------------------------
    Case("bad_reward_file_syntax_error", "train_ppo",
         lambda a, t: reward_file(t, "def reward_func(queries, prompts, labels)\n    return [0.0]\n"),
         ("my_reward.py", "SyntaxError")),
    Case("missing_reward_function", "train_ppo",
         lambda a, t: reward_file(t, "def score(queries):\n    return [0.0] * len(queries)\n"),
         ("my_reward.py", "reward_func")),
    Case("bad_reward_function_signature", "train_ppo",
         lambda a, t: reward_file(t, "def reward_func(queries):\n    return [0.0] * len(queries)\n"),
         ("my_reward.py", "reward_func", "signature")),
    Case("error_raised_importing_reward_file", "train_ppo",
         lambda a, t: reward_file(t, "import not_a_module_anywhere\n"), ("my_reward.py", "not_a_module_anywhere")),
    Case("missing_reward_file", "train_ppo", lambda a, t: ["--remote_rm_url", str(t / "none.py")],
         ("--remote_rm_url", "none.py")),
]


def call_in_process(cli: str, argv: list[str], capsys) -> tuple[int, str]:
    """Exit code and stderr of `python -m rlhfkit.cli.<cli> argv`, run in this process."""
    module = importlib.import_module(f"rlhfkit.cli.{cli}")
    capsys.readouterr()
    try:
        code = run_cli(module.main, argv, prog=module.PROG)
    except SystemExit as e:  # argparse's own errors exit from inside the parser
        code = e.code
    return code, capsys.readouterr().err


def assert_one_line_error(code: int, err: str, expect: tuple[str, ...]) -> None:
    assert code == 2, err
    assert "Traceback" not in err, err
    lines = error_lines(err)
    assert len(lines) == 1, err
    assert "error" in lines[0]
    for needle in expect:
        assert needle in lines[0], f"{needle!r} not in {lines[0]!r}"


@pytest.fixture
def no_process_group():
    """Each case must fail before a process group is joined; if one did not, leave none behind for the next. An
    earlier in-process test module may have left one: start each case without it."""
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
    yield dist
    if dist.is_initialized():
        dist.destroy_process_group()


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bad_input(case: Case, demo_assets, tmp_path, capsys, no_process_group):
    dist = no_process_group
    code, err = call_in_process(case.cli, [*base_argv(case.cli, demo_assets, tmp_path), *case.argv(demo_assets,
                                                                                                   tmp_path)], capsys)
    assert_one_line_error(code, err, case.expect)
    assert not dist.is_initialized()  # refused before any process group was joined
    assert not (tmp_path / "save").exists() or not any((tmp_path / "save").iterdir())


def test_bad_input_cases_are_distinct():
    assert len({c.id for c in CASES}) == len(CASES) >= 40


def subprocess_cli(cli: str, argv: list[str]) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE")}
    return subprocess.run([sys.executable, "-m", f"rlhfkit.cli.{cli}", *argv], capture_output=True, text=True,
                          timeout=120, env={**env, "OMP_NUM_THREADS": "1"}, cwd=REPO)


def test_malformed_data_line_exits_2_in_a_real_process(demo_assets, tmp_path):
    data = write(tmp_path / "d.jsonl", json.dumps(sft_row()) + "\n{oops\n")
    proc = subprocess_cli("train_sft", [*base_argv("train_sft", demo_assets, tmp_path), D, data])
    assert_one_line_error(proc.returncode, proc.stderr, ("d.jsonl", "line 2", "not valid JSON"))


def test_invalid_negative_learning_rate_exits_2_in_a_real_process(demo_assets, tmp_path):
    proc = subprocess_cli("train_ppo", [*base_argv("train_ppo", demo_assets, tmp_path), "--actor_learning_rate",
                                        "-1e-3"])
    assert_one_line_error(proc.returncode, proc.stderr, ("--actor_learning_rate", "-0.001"))


AGENT_TAIL = """
from rlhfkit.agents import AgentInstanceBase, MultiTurnAgentExecutor


class AgentInstance(AgentInstanceBase):
    async def step(self, states, **kwargs):
        return {"rewards": 1.0, "done": True}


class AgentExecutor(MultiTurnAgentExecutor):
    def __init__(self):
        super().__init__(AgentInstance)
"""


def agent_argv(a, tmp: Path, module_line: str, timeout: str = "10") -> list[str]:
    """train_ppo with an agent file whose module level runs `module_line` (no reward file: the agent rewards),
    imported in a worker within `timeout` seconds (--reward_timeout)."""
    argv = base_argv("train_ppo", a, tmp)
    i = argv.index("--remote_rm_url")
    del argv[i:i + 2]
    path = write(tmp / "agent.py", f"import os, sys, time\n{module_line}\n{AGENT_TAIL}")
    return [*argv, "--agent_func_path", path, "--max_steps", "1", "--reward_timeout", timeout]


@pytest.mark.parametrize("line, timeout, expect", [("sys.exit(0)", "10", "SystemExit: 0"),
                                                   ("time.sleep(1e9)", "1", "importing it took more than 1 s"),
                                                   ("raise KeyError('gone')", "10", "KeyError: 'gone'")],
                         ids=["sys_exit", "sleep", "raise"])
def test_agent_file_module_level_exit_hang_or_error_is_one_line(line, timeout, expect, demo_assets, tmp_path, capsys,
                                                                no_process_group):
    code, err = call_in_process("train_ppo", agent_argv(demo_assets, tmp_path, line, timeout), capsys)
    assert_one_line_error(code, err, ("agent.py: importing it in a worker failed", expect))
    assert not no_process_group.is_initialized()


def test_agent_file_module_level_os_exit_exits_2_in_a_real_process(demo_assets, tmp_path):
    proc = subprocess_cli("train_ppo", agent_argv(demo_assets, tmp_path, "os._exit(0)"))
    assert_one_line_error(proc.returncode, proc.stderr, ("agent.py: importing it in a worker failed",
                                                         "the worker exited (exit code 0)"))
    assert not (tmp_path / "save").exists()  # no model: refused before training
