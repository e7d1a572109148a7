"""rlhfkit's defaults against OpenRLHF 0.11's (issue 24 item 3): every default of every flag OpenRLHF's commands
have equals theirs, or is listed (DIFFERENCES, SAME_MEANING) with its reason; and a command that relies on a listed
difference says so at start, once per flag, and not for a flag it gave in any spelling."""

from __future__ import annotations

import json
import math

import pytest

from rlhfkit.config import openrlhf_defaults as od
from rlhfkit.config import openrlhf_names as theirs
from rlhfkit.config.base import field_defaults, field_names, parse_config_given
from rlhfkit.config.preference import DPOConfig, RMConfig, ServeRMConfig
from rlhfkit.config.rl import PPOConfig
from rlhfkit.config.sft import SFTConfig


def listed(table: tuple[od.Difference, ...], command: str) -> set[str]:
    return {d.flag for d in table if command in d.commands}


@pytest.mark.parametrize("command", sorted(od.COMMANDS))
def test_every_default_is_openrlhfs_or_listed(command):
    differing = od.differing_defaults(command)
    allowed = listed(od.DIFFERENCES, command) | listed(od.SAME_MEANING, command)
    unlisted = {flag: (ours, their) for flag, (ours, their) in differing.items() if flag not in allowed}
    assert not unlisted, (f"{command}: defaults that differ from OpenRLHF 0.11's, neither taken nor listed in "
                          f"rlhfkit/config/openrlhf_defaults.py (flag: (ours, theirs)): {unlisted}")
    stale = allowed - set(differing)
    assert not stale, f"{command}: listed as differing but now OpenRLHF's value; remove from the list: {stale}"


@pytest.mark.parametrize("command", sorted(od.COMMANDS))
def test_every_openrlhf_flag_is_compared_or_fails_when_given(command):
    """A flag neither mapped nor adapted must be one rlhfkit rejects (NOT_SUPPORTED): its default is then the only
    behaviour rlhfkit has, and giving it fails with the reason, so nothing differs silently."""
    cls = od.config_class(command)
    fields, defaults = field_names(cls), field_defaults(cls)
    unknown = [flag for flag, value in od.OPENRLHF[command].items()
               if od.our_values(flag, value, cls, defaults.get) is None
               and not theirs.not_supported_reason(flag, fields)]
    assert not unknown, f"{command}: OpenRLHF flags rlhfkit neither maps nor rejects: {unknown}"


def test_taken_values_are_the_dataclass_defaults():
    """The values the issue names, taken: a spot check that the comparison reads what the trainers get."""
    assert SFTConfig().data.input_template == "User: {}\nAssistant: " and SFTConfig().train.max_epochs == 2
    rm, dpo, ppo = RMConfig(), DPOConfig(), PPOConfig()
    assert (rm.strategy.learning_rate, rm.strategy.micro_train_batch_size, rm.data.max_len) == (9e-6, 1, 512)
    assert (dpo.strategy.learning_rate, dpo.data.max_len, dpo.data.eval_split) == (1e-5, 512, "test")
    assert rm.data.max_samples == dpo.data.max_samples == SFTConfig().data.max_samples == 10**6
    assert (ppo.strategy.micro_train_batch_size, ppo.rollout.micro_rollout_batch_size) == (1, 1)
    assert ppo.rollout.vllm_gpu_memory_utilization == 0.95
    assert ppo.algo.vllm_is_truncated_threshold == [0.5, 5.0]


def test_the_table_is_openrlhf_011s_argparse_as_the_tool_reads_it(tmp_path):
    """The extraction tool on a file shaped like OpenRLHF's CLI: loops over roles, expressions, run names."""
    import importlib.util
    from pathlib import Path

    tool = Path(__file__).resolve().parents[2] / "tools" / "openrlhf_defaults.py"
    spec = importlib.util.spec_from_file_location("openrlhf_defaults_tool", tool)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    cli = tmp_path / "train_x.py"
    cli.write_text(
        "import argparse\nfrom datetime import datetime\np = argparse.ArgumentParser()\n"
        "p.add_argument('--ckpt.max_mem', type=int, default=int(1e8))\n"
        "p.add_argument('--ckpt.cap', type=float, default=float('inf'))\n"
        "p.add_argument('--flag', action='store_true')\n"
        "p.add_argument('--no_flag', dest='flag', action='store_false')\n"
        "p.add_argument('--logger.wandb.run_name', default='x_%s' % datetime.now().strftime('%m%d'))\n"
        "for prefix in ('actor', 'critic'):\n"
        "    p.add_argument(f'--{prefix}.adam.lr', default=1e-6 if prefix == 'actor' else 9e-6)\n"
        "for i in range(3):\n    pass\n")
    assert module.read_defaults(cli) == {"ckpt.max_mem": 100000000, "ckpt.cap": math.inf, "flag": False,
                                         "logger.wandb.run_name": "x_(start time)", "actor.adam.lr": 1e-6,
                                         "critic.adam.lr": 9e-6}
    assert od.OPENRLHF["train_ppo_ray"]["critic.adam.lr"] == 9e-6  # the loop-built flags are in the table


def test_docs_table_lists_every_difference():
    table = od.defaults_table()
    for d in (*od.DIFFERENCES, *od.SAME_MEANING):
        assert f"`--{d.flag}`" in table and d.why in table


# -- the start-up line ---------------------------------------------------------------------------------------
SFT = ["--pretrain", "m", "--dataset", "d.jsonl"]
PPO = ["--pretrain", "m", "--prompt_data", "p.jsonl", "--remote_rm_url", "r.py", "--advantage_estimator",
       "group_norm", "--n_samples_per_prompt", "2", "--rollout_batch_size", "8", "--train_batch_size", "16",
       "--init_kl_coef", "0"]


def notes(cls: type, command: str, argv: list[str]) -> list[str]:
    cfg, given = parse_config_given(cls, argv, command)
    return od.startup_notes(command, cfg, given)


def flags_noted(lines: list[str]) -> list[str]:
    return [line.split(" not given")[0].removeprefix("rlhfkit: ").split()[0] for line in lines]


def on_cpu(monkeypatch):
    """The device-dependent defaults as on a machine without a GPU (the CPU test machines are; a GPU runner
    must not change what these tests expect)."""
    from rlhfkit.config import devices

    monkeypatch.setattr(devices, "cuda_available", lambda: False)


def test_startup_lines_name_each_listed_default_a_command_relies_on(monkeypatch):
    on_cpu(monkeypatch)
    lines = notes(PPOConfig, "train_ppo_ray", PPO)
    # no critic (group_norm), no reference (no KL), no reward model (remote): only the actor's device count
    assert flags_noted(lines) == ["--bf16", "--attn_implementation", "--actor_num_gpus_per_node",
                                  "--generate_max_len"]
    assert lines[0] == ("rlhfkit: --bf16 (--ds.param_dtype) not given: fp32 here, OpenRLHF uses bf16 "
                        "(docs/migration.md#defaults)")
    assert "--actor_num_gpus_per_node (--actor.num_gpus_per_node) not given: 1 here, OpenRLHF uses 8" in lines[2]
    assert notes(PPOConfig, "train_ppo", PPO) == lines  # rlhfkit's local train_ppo parses the same flags
    served = notes(ServeRMConfig, "serve_rm", ["--reward_pretrain", "m"])
    assert "rlhfkit: --host not given: 127.0.0.1 here, OpenRLHF uses 0.0.0.0 (docs/migration.md#defaults)" in served


def test_a_long_response_beside_a_prompt_limit_starts_without_a_total_length_error(monkeypatch):
    """OpenRLHF's --data.max_len default (2048, prompt + response) cannot stand beside --generate_max_len 4096: the
    start-up notes used to convert it anyway and stopped the run with "leaves no room", though the user gave
    --prompt_max_len and never --data.max_len."""
    on_cpu(monkeypatch)
    argv = [*PPO, "--prompt_max_len", "1024", "--generate_max_len", "4096"]
    assert "--generate_max_len" not in flags_noted(notes(PPOConfig, "train_ppo_ray", argv))


def test_conditional_differences_appear_only_when_the_run_uses_them(monkeypatch):
    on_cpu(monkeypatch)
    assert flags_noted(notes(SFTConfig, "train_sft", SFT)) == ["--bf16", "--attn_implementation"]
    with_ckpt = flags_noted(notes(SFTConfig, "train_sft", [*SFT, "--save_steps", "10", "--use_wandb", "offline"]))
    assert with_ckpt == ["--bf16", "--attn_implementation", "--ckpt_path", "--wandb_project"]
    gae = flags_noted(notes(PPOConfig, "train_ppo_ray", [*PPO[:7], "gae", *PPO[8:]]))
    assert "--critic_num_gpus_per_node" in gae and "--ref_num_gpus_per_node" not in gae


@pytest.mark.parametrize("given", [
    ["--bf16", "--attn_implementation", "sdpa", "--host", "0.0.0.0", "--batch_size", "4", "--normalize_reward"],
    ["--ds.param_dtype", "fp32", "--ds.attn_implementation", "eager", "--host", "::1", "--batch_size", "4",
     "--reward.normalize_enable"],
])
def test_no_line_for_a_flag_given_in_any_spelling(monkeypatch, given):
    on_cpu(monkeypatch)
    assert notes(ServeRMConfig, "serve_rm", ["--reward_pretrain", "m", *given]) == []


def test_no_line_for_a_flag_given_in_the_config_file(monkeypatch, tmp_path):
    on_cpu(monkeypatch)
    config = tmp_path / "c.json"
    config.write_text(json.dumps({"ds": {"param_dtype": "bf16"}, "attn_implementation": "eager",
                                  "actor.num_gpus_per_node": 1, "data": {"generate_max_len": 64}}))
    assert notes(PPOConfig, "train_ppo_ray", [*PPO, "--config", str(config)]) == []


def test_auto_resolves_to_openrlhfs_values_on_a_gpu_and_then_says_nothing(monkeypatch):
    from rlhfkit.config import devices

    monkeypatch.setattr(devices, "cuda_available", lambda: True)
    monkeypatch.setattr(devices, "flash_attn_installed", lambda: True)
    cfg, given = parse_config_given(SFTConfig, SFT, "train_sft")
    assert cfg.model.bf16 is True and cfg.model.attn_implementation == "flash_attention_2"
    assert od.startup_notes("train_sft", cfg, given) == []
    cfg, _ = parse_config_given(SFTConfig, [*SFT, "--param_dtype", "fp32", "--attn_implementation", "sdpa"], "t")
    assert cfg.model.bf16 is False and cfg.model.attn_implementation == "sdpa"


def test_auto_on_cpu_is_fp32_and_sdpa(monkeypatch):
    on_cpu(monkeypatch)
    cfg, _ = parse_config_given(RMConfig, SFT, "train_rm")
    assert cfg.model.bf16 is False and cfg.model.attn_implementation == "sdpa"


def test_commands_without_an_openrlhf_twin_print_nothing():
    from rlhfkit.config.preference import KTOConfig

    cfg, given = parse_config_given(KTOConfig, [*SFT, "--micro_train_batch_size", "2"], "train_kto")
    assert od.startup_notes("train_kto", cfg, given) == []


def test_the_cli_prints_the_lines_on_rank_0_only(monkeypatch, capsys):
    from rlhfkit.cli.common import note_openrlhf_defaults

    on_cpu(monkeypatch)
    cfg, given = parse_config_given(SFTConfig, SFT, "t")
    note_openrlhf_defaults("rlhfkit.cli.train_sft", cfg, given)
    assert capsys.readouterr().err.count("rlhfkit: --") == 2
    monkeypatch.setenv("RANK", "1")
    note_openrlhf_defaults("rlhfkit.cli.train_sft", cfg, given)
    assert capsys.readouterr().err == ""
