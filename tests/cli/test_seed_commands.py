"""Every `openrlhf.cli.*` command block of OpenRLHF's examples runs with `openrlhf` -> `rlhfkit`.

The seeds (../shared/seeds/, five files) are what users paste. Each block is extracted, counted (a lost block fails
the count), and:
1. parsed as typed, flag by flag: no seed flag may be unknown to rlhfkit;
2. scaled down to the tiny demo assets and run: sizes (batch sizes, lengths, steps), paths (model -> the demo
   model, data -> the demo files and their keys, save/checkpoint paths -> tmp), device counts (GPUs and nodes ->
   1, vLLM engines and tensor parallelism -> 1) and GPU-only kernels (`--flash_attn` -> sdpa, after checking its
   one-line CPU message). Scaling replaces values and adds what a partial block ("# ... other args") leaves to the
   reader; it removes only what carries host data: the `ray job submit` / `deepspeed` launcher with its
   `--address` and `--runtime-env-json`, and the `...` placeholder. Runs of 2 RL steps share this process's Ray
   cluster; identical scaled commands run once, and a block whose scaled command is another block's with some of
   its features left out rides on that block's run (`COVERED`: the fields that differ are checked, and each of the
   block's values of them runs in some other block).
3. The agent blocks (`--agent_func_path`, `--async_train`) run like the others: their agent file is the example
   of the same name in examples/ (else examples/agent_func.py), trained asynchronously for 2 steps.
"""

from __future__ import annotations

import codecs
import json
import os
import re
import shlex
from dataclasses import dataclass
from pathlib import Path

import pytest

from rlhfkit.cli.common import run_cli
from rlhfkit.config.base import build_parser
from rlhfkit.config.preference import DPOConfig, RMConfig
from rlhfkit.config.rl import PPOConfig
from rlhfkit.config.sft import SFTConfig
from rlhfkit.errors import UserError
from tests.helpers import REPO

REWARD = str(REPO / "tests" / "distributed" / "reward_exact_match.py")
TEMPLATE = "User: {}\nAssistant: "
CONFIGS = {"train_sft": SFTConfig, "train_rm": RMConfig, "train_dpo": DPOConfig, "train_ppo_ray": PPOConfig}
# command blocks per seed file, by module: the seeds are fixed documents, so any change here is a lost block
EXPECTED = {"000": {}, "001": {"train_ppo_ray": 13, "train_rm": 1, "train_dpo": 1},
            "002": {"train_sft": 1, "train_rm": 1, "train_ppo_ray": 3}, "003": {"train_ppo_ray": 1}, "004": {}}
AGENT_FLAGS = ("--agent_func_path", "--async_train")
HOST_ONLY = ("--address", "--runtime-env-json")  # ray job submit's: where the cluster and the checkout are
GPU_ONLY = {"--flash_attn": (["--attn_implementation", "sdpa"], "needs the flash-attn package")}


def seeds_dir() -> Path | None:
    for candidate in (os.environ.get("RLHFKIT_SEEDS_DIR"), *(p / "shared" / "seeds" for p in REPO.parents)):
        if candidate and Path(candidate).is_dir():
            return Path(candidate)
    return None


@dataclass(frozen=True)
class Block:
    seed: str  # "001"
    index: int  # order in its file
    module: str  # train_ppo_ray
    argv: tuple[str, ...]  # the module's flags as typed (launcher and placeholders removed)

    @property
    def id(self) -> str:
        return f"{self.seed}-{self.index}-{self.module}"

    @property
    def agent(self) -> bool:
        return any(flag in self.argv for flag in AGENT_FLAGS)


def _ansi_c(text: str) -> str:
    """bash's $'...' quoting (OpenRLHF's input templates), which shlex does not know."""
    return re.sub(r"\$'((?:[^'\\]|\\.)*)'", lambda m: shlex.quote(codecs.decode(m.group(1), "unicode_escape")), text)


def extract_blocks(directory: Path) -> list[Block]:
    blocks = []
    for path in sorted(directory.glob("*.txt")):
        logical, current = [], ""
        for line in path.read_text(encoding="utf-8").splitlines():  # join backslash continuations
            if line.rstrip().endswith("\\"):
                current += line.rstrip()[:-1] + " "
            else:
                logical.append(current + line)
                current = ""
        logical.append(current)
        index = 0
        for line in logical:
            match = re.search(r"(?:-m|--module)\s+openrlhf\.cli\.(\w+)", line)
            if not match:
                continue
            tokens = shlex.split(_ansi_c(line[match.end():]), comments=True)
            blocks.append(Block(path.name[:3], index, match.group(1), tuple(t for t in tokens if t != "...")))
            index += 1
    return blocks


SEEDS = seeds_dir()
BLOCKS = extract_blocks(SEEDS) if SEEDS else []
pytestmark = pytest.mark.skipif(SEEDS is None, reason="OpenRLHF's examples (../shared/seeds) are not on this machine")


def test_every_block_is_found():
    counts: dict[str, dict[str, int]] = {seed: {} for seed in EXPECTED}
    for b in BLOCKS:
        counts[b.seed][b.module] = counts[b.seed].get(b.module, 0) + 1
    assert counts == EXPECTED
    assert len(BLOCKS) == 21 and sum(b.agent for b in BLOCKS) == 2


@pytest.mark.parametrize("block", BLOCKS, ids=lambda b: b.id)
def test_every_seed_flag_is_known(block):
    """Parse each block as typed: every flag is one of rlhfkit's (or fails with "not supported yet")."""
    parser = build_parser(CONFIGS[block.module], block.module)
    flags = [t.split("=")[0] for t in block.argv if t.startswith("--")]
    unknown = [f for f in flags if f not in parser._option_string_actions]
    assert not unknown, unknown
    parser.parse_args(list(block.argv))


# -- scaling ---------------------------------------------------------------------------------------------------
def _set(argv: list[str], flag: str, value: str, *, add: bool = True) -> None:
    if flag in argv:
        argv[argv.index(flag) + 1] = value
    elif add:
        argv += [flag, value]


def scale(block: Block, assets, out: Path, reward_model: Path | None = None) -> list[str]:
    """The block's flags at the demo's scale (see the module docstring); every seed flag stays. `reward_model`:
    a model with a value head for --reward_pretrain / --critic_pretrain (a plain model is refused there)."""
    argv = list(block.argv)
    for flag, (replacement, _) in GPU_ONLY.items():
        if flag in argv:
            i = argv.index(flag)
            argv[i:i + 1] = replacement
    model, chat = str(assets.model_dir), "--apply_chat_template" in argv
    _set(argv, "--pretrain", model)
    _set(argv, "--save_path", str(out / "final"))
    _set(argv, "--ckpt_path", str(out / "ckpt"), add="--load_checkpoint" in argv)
    if "--save_steps" in argv and int(argv[argv.index("--save_steps") + 1]) > 0:
        _set(argv, "--save_steps", "2")
    if "--use_wandb" in argv:
        _set(argv, "--use_wandb", "offline")  # OpenRLHF's {wandb_token} / $WANDB_API_KEY: a secret of the host
    if block.module == "train_ppo_ray":
        return _scale_rl(argv, assets, chat, reward_model)
    _set(argv, "--train_batch_size", "4")
    _set(argv, "--micro_train_batch_size", "2")
    _set(argv, "--max_len", "96")
    _set(argv, "--max_samples", "8")  # 2 optimizer steps
    if block.module == "train_sft":
        _set(argv, "--dataset", str(assets.sft_train))
        _set(argv, "--input_key", "question")
        _set(argv, "--output_key", "response")
    else:
        _set(argv, "--dataset", str(out.parent / "chat_pairs.jsonl"))
        _set(argv, "--chosen_key", "chosen_messages" if chat else "chosen")
        _set(argv, "--rejected_key", "rejected_messages" if chat else "rejected")
    return argv + ["--disable_progress_bar"]


def _scale_rl(argv: list[str], assets, chat: bool, reward_model: Path | None) -> list[str]:
    for role in ("actor", "critic", "ref", "reward"):  # keep 0 (an absent or colocated role), else one device
        for flag in (f"--{role}_num_nodes", f"--{role}_num_gpus_per_node"):
            if flag in argv and argv[argv.index(flag) + 1] != "0":
                _set(argv, flag, "1")
    if "--vllm_num_engines" in argv and argv[argv.index("--vllm_num_engines") + 1] != "0":
        _set(argv, "--vllm_num_engines", "1")
    _set(argv, "--vllm_tensor_parallel_size", "1", add=False)
    for flag in ("--reward_pretrain", "--critic_pretrain"):
        _set(argv, flag, str(reward_model or assets.model_dir), add=False)
    if "--agent_func_path" in argv:  # OpenRLHF's agent file -> the example of that name (its step rewards)
        example = REPO / "examples" / Path(argv[argv.index("--agent_func_path") + 1]).name
        _set(argv, "--agent_func_path", str(example if example.is_file() else REPO / "examples" / "agent_func.py"))
        _set(argv, "--label_key", "answer")
    elif "--reward_pretrain" not in argv:
        _set(argv, "--remote_rm_url", REWARD)  # an OpenRLHF reward function file -> the demo's exact-match reward
        _set(argv, "--label_key", "answer")
    _set(argv, "--prompt_data", str(assets.rl_train))
    _set(argv, "--input_key", "prompt")
    if not chat:
        _set(argv, "--input_template", TEMPLATE)
    estimator = argv[argv.index("--advantage_estimator") + 1] if "--advantage_estimator" in argv else "gae"
    samples = 1 if estimator in ("gae", "reinforce") else 2
    _set(argv, "--n_samples_per_prompt", str(samples))
    _set(argv, "--rollout_batch_size", "2")
    _set(argv, "--micro_rollout_batch_size", "2")
    _set(argv, "--train_batch_size", str(2 * samples))
    _set(argv, "--micro_train_batch_size", "1")
    _set(argv, "--max_samples", "4")  # 2 RL steps of 2 prompts
    _set(argv, "--prompt_max_len", "32")
    _set(argv, "--generate_max_len", "8")
    return argv + ["--disable_progress_bar"]


def test_gpu_only_flags_say_so_on_cpu():
    """OpenRLHF's flags that scaling swaps for a CPU equivalent fail on CPU with their one-line reason."""
    from rlhfkit.models.loading import resolve_attn_implementation

    if __import__("importlib").util.find_spec("flash_attn") is not None:
        pytest.skip("flash-attn is installed here")
    with pytest.raises(UserError, match=GPU_ONLY["--flash_attn"][1]):
        resolve_attn_implementation("sdpa", flash_attn=True)


def test_scaling_keeps_every_seed_flag(demo_assets, tmp_path):
    for block in BLOCKS:
        scaled = scale(block, demo_assets, tmp_path)
        kept = {t for t in scaled if t.startswith("--")} | set(GPU_ONLY)
        assert {t for t in block.argv if t.startswith("--")} <= kept, block.id
        for flag in HOST_ONLY:
            assert flag not in scaled


# -- running -------------------------------------------------------------------------------------------------
def _runnable(blocks: list[Block]) -> dict[str, Block]:
    """Every block, identical commands once: two blocks are identical when, scaled, they parse to the same config
    (e.g. one spells out a default the other leaves implicit)."""
    from types import SimpleNamespace

    from rlhfkit.config.base import parse_config

    where = SimpleNamespace(model_dir="MODEL", rl_train="RL", sft_train="SFT")
    seen: list[tuple[str, object]] = []
    runnable = {}
    for b in blocks:
        cfg = parse_config(CONFIGS[b.module], scale(b, where, Path("OUT")), b.module)
        if (b.module, cfg) not in seen:
            seen.append((b.module, cfg))
            runnable[b.id] = b
    return runnable


RUNNABLE = _runnable(BLOCKS)
# Blocks that do not run on their own (each train_ppo_ray run costs ~30 s of the Ray test worker): block -> (the
# block whose run covers it, the config fields in which the two differ). The covering run sets the block's flags to
# the same values and adds features: gradient checkpointing, packing, a --load_checkpoint that finds no checkpoint,
# an HF checkpoint, wandb; 002-2 formats its prompts with the chat template where 001-0, 001-2 and 001-5 give an
# --input_template, which most other runs train with (001-0 also trains verbatim, 2-rank actor and 2 vLLM engines, in
# distributed/test_ray_ppo.py::test_seed_hybrid_engine_ppo_command). Where a block asks for something its covering
# run does not do (001-7's --normalize_reward), another run does it. The test below checks both.
_LIKE_002_2 = {"apply_chat_template", "input_template", "ckpt_path", "enforce_eager", "save_hf_ckpt", "use_wandb"}
COVERED = {
    "001-13-train_ppo_ray": ("001-9-train_ppo_ray", {"load_checkpoint", "ckpt_path"}),
    "001-0-train_ppo_ray": ("002-2-train_ppo_ray", _LIKE_002_2),
    "001-2-train_ppo_ray": ("002-2-train_ppo_ray", _LIKE_002_2 | {"gradient_checkpointing", "packing_samples",
                                                                  "vllm_gpu_memory_utilization"}),
    "001-5-train_ppo_ray": ("002-2-train_ppo_ray", _LIKE_002_2 | {"actor_learning_rate", "gradient_checkpointing",
                                                                  "normalize_reward", "packing_samples"}),
    "001-7-train_ppo_ray": ("001-10-train_ppo_ray",
                            {"normalize_reward", "packing_samples", "save_hf_ckpt", "use_wandb", "wandb_project"}),
}
RUNS = sorted(set(RUNNABLE) - set(COVERED))
# The offline trainers' runs and the train_ppo_ray runs are two tests: make test's Ray worker (tests/selection.py)
# takes only the second.
RAY_RUNS = [b for b in RUNS if RUNNABLE[b].module == "train_ppo_ray"]
OFFLINE_RUNS = [b for b in RUNS if b not in RAY_RUNS]


def _scaled_fields(block: Block) -> dict[str, object]:
    """The block's config, scaled as for its run (placeholder paths, one output directory for all), flat."""
    from types import SimpleNamespace

    from rlhfkit.config.base import field_values, parse_config

    where = SimpleNamespace(model_dir="MODEL", rl_train="RL", sft_train="SFT")
    return field_values(parse_config(CONFIGS[block.module], scale(block, where, Path("OUT")), block.module))


def test_covered_blocks_differ_from_their_run_only_as_listed():
    """Each covered block parses and validates, differs from its covering run in exactly the listed fields, and
    its own value of each of them is trained by a run."""
    runs = {run: _scaled_fields(RUNNABLE[run]) for run in RUNS if RUNNABLE[run].module == "train_ppo_ray"}
    for block_id, (run, fields) in COVERED.items():
        assert block_id in RUNNABLE and run in RUNS, (block_id, run)
        mine = _scaled_fields(RUNNABLE[block_id])
        assert {f for f in mine if mine[f] != runs[run][f]} == fields, block_id
        for field in fields:
            assert any(cfg[field] == mine[field] for cfg in runs.values()), (block_id, field, mine[field])


@pytest.fixture(scope="module")
def chat_pairs(demo_assets, tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("seed_runs") / "chat_pairs.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in demo_assets.read("pref_train")[:64]))
    return path


@pytest.fixture(scope="module")
def wandb_offline(tmp_path_factory):
    saved = {k: os.environ.get(k) for k in ("WANDB_MODE", "WANDB_DIR", "WANDB_SILENT")}
    os.environ.update(WANDB_MODE="offline", WANDB_SILENT="true", WANDB_DIR=str(tmp_path_factory.mktemp("wandb")))
    yield
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


def _main(module: str):
    import importlib

    return importlib.import_module(f"rlhfkit.cli.{module}").main


def _run_block(block_id: str, demo_assets, demo_reward_model, chat_pairs, capsys) -> None:
    """Run the scaled block through its CLI: it exits 0, logs two training steps and saves its model."""
    block = RUNNABLE[block_id]
    out = chat_pairs.parent / block_id
    argv = scale(block, demo_assets, out, demo_reward_model)
    code = run_cli(_main(block.module), argv, prog=block.module)
    assert code == 0, capsys.readouterr().err[-3000:]
    rows = [json.loads(line) for line in (out / "final" / "metrics.jsonl").read_text().splitlines()]
    key = "train/actor/policy_loss" if block.module == "train_ppo_ray" else "train/loss"
    assert len([r for r in rows if key in r]) == 2, rows[-3:]
    assert (out / "final" / "model.safetensors").is_file() or (out / "final" / "adapter_model.safetensors").is_file()


@pytest.mark.parametrize("block_id", OFFLINE_RUNS)
def test_seed_block_runs(block_id, demo_assets, demo_reward_model, chat_pairs, wandb_offline, capsys):
    _run_block(block_id, demo_assets, demo_reward_model, chat_pairs, capsys)


@pytest.mark.parametrize("block_id", RAY_RUNS)
def test_seed_ray_block_runs(block_id, demo_assets, demo_reward_model, chat_pairs, wandb_offline, capsys):
    from tests.distributed.ray_cluster import ensure_ray

    ensure_ray()
    _run_block(block_id, demo_assets, demo_reward_model, chat_pairs, capsys)
