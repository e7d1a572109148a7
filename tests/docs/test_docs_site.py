"""The docs site builds with strict warnings, has a page with the flags of every command, and needs no network to
view (no CDN scripts or fonts; formulas are MathML made at build time)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from rlhfkit.cli import catalog
from rlhfkit.config.base import iter_fields
from tests.deploy.shell_stubs import rlhfkit_calls, run_with_stubs

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("site")
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)],
                          cwd=REPO, capture_output=True, text=True, timeout=180,
                          env={"PATH": "/usr/bin:/bin", "NO_MKDOCS_2_WARNING": "1", "OMP_NUM_THREADS": "1",
                               "HOME": str(out.parent)})
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "WARNING" not in proc.stderr, proc.stderr[-4000:]
    return out


def _text(html: str) -> str:
    return re.sub(r"<[^>]+>", "", html)


def test_every_command_has_a_page_with_all_its_flags(site):
    overview = (site / "cli" / "index.html").read_text()
    for command in catalog.commands():
        page = site / "cli" / f"{command.name}.html"
        assert page.is_file(), f"no docs page for rlhfkit {command.name}"
        assert f'href="{command.name}.html"' in overview, f"the commands overview does not link {command.name}"
        text = _text(page.read_text())
        assert command.module_path in text
        cls = catalog.config_class(command)
        if cls is not None:
            flags = [f"--{name}" for _, name, _, _ in iter_fields(cls)]
        else:
            flags = [o for a in catalog.parser_of(command)._actions for o in a.option_strings if o not in ("-h",
                                                                                                            "--help")]
        assert flags, f"{command.name}: no flags found to check"
        missing = [f for f in flags if f not in text]
        assert not missing, f"{command.name} page lacks {missing}"


def test_nav_holds_the_guides_and_the_migration_page(site):
    index = (site / "index.html").read_text()
    for page in ("quickstart", "architecture", "offline-training", "algorithms", "rewards", "agents", "distributed",
                 "batch-inference", "reports", "memory-planner", "deploy", "multinode", "migration", "migration-trl",
                 "troubleshooting", "benchmarks", "CONVENTIONS", "cli/train_ppo_ray"):
        assert (site / f"{page}.html").is_file(), page
        assert f'href="{page}.html"' in index, f"{page} is not in the navigation"
    for svg in ("layout-separate", "layout-hybrid", "multinode-cluster"):
        assert f'src="images/{svg}.svg"' in (site / "distributed.html").read_text()
        assert (site / "images" / f"{svg}.svg").is_file()


def test_the_architecture_page_states_the_layers_once():
    """One fenced `layers` block, one folder of rlhfkit/ per line: the list tests/test_import_graph.py enforces."""
    text = (REPO / "docs" / "architecture.md").read_text()
    blocks = re.findall(r"```layers\n(.*?)```", text, re.S)
    assert len(blocks) == 1, "docs/architecture.md needs exactly one ```layers block"
    layers = blocks[0].split()
    assert len(layers) == len(set(layers)), "a folder is listed twice"
    folders = {p.parent.name for p in (REPO / "rlhfkit").glob("*/__init__.py")}
    assert set(layers) == folders, f"not listed: {sorted(folders - set(layers))}; no such folder: " \
                                   f"{sorted(set(layers) - folders)}"


def test_readme_is_a_front_page():
    """README.md stays short (the flags, benchmarks and guides live on the docs site) and points at the pages."""
    text = (REPO / "README.md").read_text()
    assert len(text.splitlines()) <= 220
    for page in ("quickstart", "architecture", "offline-training", "memory-planner", "batch-inference", "reports",
                 "benchmarks"):
        assert f"docs/{page}.md" in text, page


def test_formulas_are_mathml_built_offline(site):
    html = (site / "algorithms.html").read_text()
    assert html.count("<math") >= 20
    assert 'class="arithmatex"' not in html, "a formula was left for a script to render"
    assert "mathjax" not in html.lower() and "katex" not in html.lower()
    # the GAE recursion, rendered: delta, gamma and lambda as MathML identifiers (latex2mathml writes entities)
    for letter in "δγλ":
        assert f"<mi>&#x{ord(letter):05X};</mi>" in html, letter


def test_no_page_loads_anything_from_the_network(site):
    external_load = re.compile(
        r"<(?:script|img|iframe|source)\b[^>]*\bsrc=\"(?:https?:)?//|<link\b[^>]*\bhref=\"(?:https?:)?//", re.I)
    for page in site.rglob("*.html"):
        html = page.read_text()
        hit = external_load.search(html)
        assert hit is None, f"{page.relative_to(site)} loads {html[hit.start():hit.start() + 120]}"
        assert 'class="mermaid"' not in html, "Mermaid is rendered by a CDN script; use an SVG"
    for css in site.rglob("*.css"):
        assert not re.search(r"url\([\"']?(?:https?:)?//", css.read_text()), css


def _complete_bash_blocks() -> list[tuple[str, str]]:
    """(page, block) for every bash example in docs/ without placeholders (`...`, `<...>`, `[flags]`)."""
    blocks = []
    for page in sorted((REPO / "docs").glob("*.md")):
        for block in re.findall(r"```bash\n(.*?)```", page.read_text(), re.S):
            if not any(mark in block for mark in ("...", "<", "[flags]")):
                blocks.append((page.name, block))
    return blocks


def test_complete_commands_in_the_docs_run_and_parse_with_their_flags(tmp_path):
    """The guides' copy-paste commands, run by bash with every program replaced by a recorder: each rlhfkit
    command in them (also behind `ray job submit --`) must parse with its command's flags."""
    blocks = _complete_bash_blocks()
    checked = set()
    for i, (page, block) in enumerate(blocks):
        env = {"HEAD_IP": "127.0.0.1", "KEY": "k", "WANDB_TOKEN": "w"}
        run = run_with_stubs(block, env, tmp_path / str(i), cwd=REPO, also_record=("docker", "make", "curl"))
        assert run.returncode == 0, f"{page}: {block[:80]!r} failed: {run.stderr}"
        for call in rlhfkit_calls([c for c in run.calls if c[0] != "docker"]):
            command = catalog.by_module(call.module)
            assert command is not None, f"{page}: rlhfkit.cli.{call.module} is not a command"
            try:
                catalog.parse_flags(command, call.argv)
            except SystemExit:
                pytest.fail(f"{page}: rlhfkit.cli.{call.module} rejects the flags of {block[:80]!r}")
            checked.add((page, call.module))
    assert {("multinode.md", "train_ppo_ray"), ("quickstart.md", "train_sft"), ("quickstart.md", "train_ppo_ray"),
            ("rewards.md", "serve_rm")} <= checked
