"""Session-wide test settings: one thread per process, offline, loopback-only Ray."""

from __future__ import annotations

import os

for key, value in {
    "OMP_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "HF_HUB_OFFLINE": "1",
    "HF_DATASETS_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "WANDB_MODE": "offline",
    "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
    "RAY_AUTH_MODE": "disabled",
    "RAY_USAGE_STATS_ENABLED": "0",
}.items():
    os.environ.setdefault(key, value)

import torch  # noqa: E402

torch.set_num_threads(1)

import pytest  # noqa: E402

LAUNCHER_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@pytest.fixture(scope="module", autouse=True)
def _launcher_env_stays_in_its_module():
    """A trainer run in-process (a CLI's main) joins a world of one: it sets RANK / MASTER_PORT ... in os.environ
    and leaves its process group listening on that port. Restore the variables after each module, so later
    subprocesses do not inherit a port that is taken (EADDRINUSE). The group itself stays: DeepSpeed keeps a
    handle on it, and later in-process modules reuse it."""
    saved = {k: os.environ.get(k) for k in LAUNCHER_VARS}
    yield
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


@pytest.fixture()
def world_of_one():
    """A test that joins a process group in this process (DeepSpeed engines, a CLI's main) runs in a world of one;
    the environment is restored after it (`tests.helpers.launcher_env_of_one`)."""
    from tests.helpers import launcher_env_of_one

    with launcher_env_of_one():
        yield


@pytest.fixture(scope="session")
def demo_assets(tmp_path_factory):
    """The embedded tokenizer, tiny model and task data, built once per test session."""
    from rlhfkit.demo.assets import build_demo_assets

    return build_demo_assets(tmp_path_factory.mktemp("demo_assets"), seed=0)


@pytest.fixture(scope="session")
def vlm_assets(tmp_path_factory):
    """The tiny Qwen2-VL and a few image-task records of each split (rlhfkit/demo/vlm_assets.py), once per session."""
    from rlhfkit.demo.vlm_assets import build_vlm_assets

    return build_vlm_assets(tmp_path_factory.mktemp("vlm_assets"), seed=0, n_sft=16, n_eval=8, n_pref=16, n_rl=8)


@pytest.fixture(scope="session")
def demo_reward_model(demo_assets, tmp_path_factory):
    """The demo backbone with a seeded value head and its tokenizer, saved as train_rm saves a reward model (a
    plain language model is refused as --reward_pretrain)."""
    import torch
    from transformers import AutoTokenizer

    from rlhfkit.models.value_model import load_value_model

    out = tmp_path_factory.mktemp("demo_reward_model")
    torch.manual_seed(0)
    load_value_model(str(demo_assets.model_dir), require_head=False).save_pretrained(out)
    AutoTokenizer.from_pretrained(demo_assets.model_dir).save_pretrained(out)
    return out



# Session fixtures shared by tests/trainers, tests/rl and tests/inference (an SFT model of the demo addition task).
from tests.sft_fixtures import max_assets, restore_env, sft_model_dir  # noqa: E402,F401


def pytest_collection_modifyitems(config, items):
    """Mark the `slow` tests (left out by `make test-fast`); in an xdist worker, put the slow groups first."""
    from tests.selection import mark_and_order

    mark_and_order(items, under_xdist=hasattr(config, "workerinput"))


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """`-n 2` (xdist's default `--dist load`) schedules by the groups of tests/selection.py."""
    if config.getvalue("dist") != "load":
        return None
    from tests.group_scheduling import GroupScheduling

    return GroupScheduling(config, log)


# make test's balance: the seconds each xdist worker spent in tests, and the "ray" group's share (tests/selection.py),
# so a run shows which worker is the long path before anyone moves tests between them.
_BUSY: dict[str, float] = {}


def pytest_runtest_logreport(report):
    node = getattr(report, "node", None)  # set by xdist's controller on a worker's report
    if node is not None:
        from tests.selection import group_of

        for key in (node.gateway.id, f"{node.gateway.id} {group_of(report.nodeid)}"):
            _BUSY[key] = _BUSY.get(key, 0.0) + report.duration


def pytest_terminal_summary(terminalreporter):
    workers = sorted(k for k in _BUSY if " " not in k)
    if workers:
        line = "; ".join(f"{w} {_BUSY[w]:.0f} s (ray group {_BUSY.get(f'{w} ray', 0.0):.0f} s)" for w in workers)
        terminalreporter.write_line(f"time in tests per worker: {line}")
