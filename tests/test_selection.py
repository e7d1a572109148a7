"""tests/selection.py: every entry of its lists names a test module or function that exists (a renamed or moved test
must not fall silently out of the `slow` selection or out of the "ray" group), and node ids map to their groups."""

from __future__ import annotations

import ast

import pytest

from tests.selection import RAY, SLOW, TESTS, group_of, split


def functions_of(module: str) -> set[str]:
    tree = ast.parse((TESTS / module).read_text(encoding="utf-8"))
    return {node.name for node in tree.body if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)}


@pytest.mark.parametrize("entry", sorted(SLOW | RAY))
def test_entry_names_an_existing_test(entry):
    module, _, function = entry.partition("::")
    assert (TESTS / module).is_file(), f"{entry}: no such test module"
    if function:
        assert function in functions_of(module), f"{entry}: no such test function in {module}"


def test_node_ids_map_to_their_module_or_the_ray_group():
    assert split("tests/cli/test_demo.py::test_x[a::b]") == ("cli/test_demo.py", "test_x")
    assert group_of("tests/data/test_readers.py::test_parquet_csv_arrow") == "data/test_readers.py"
    assert group_of("tests/distributed/test_ray_ppo.py::test_two_steps_in_every_cell[gae]") == "ray"
    on_ray = "tests/cli/test_batch_inference.py::test_vllm_engines_on_ray_match_the_transformers_engine"
    assert group_of(on_ray) == "ray"
    assert group_of("tests/cli/test_batch_inference.py::test_generate_best_of_n_with_reward_function") \
        == "cli/test_batch_inference.py"
    kill = "tests/run/test_kill_safety.py::test_ppo_ray_driver_sigkill_leaks_no_actors_and_resumes_to_the_same_weights"
    assert group_of(kill) == "run/test_kill_safety.py"  # its own cluster in a child: beside the Ray group
