# Two commands on a fresh machine: `make demo` and `make test`. Each creates .venv when it is
# missing and installs into it only when pyproject.toml is newer than the last install.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
# The GPU's step compiled here, without a GPU (bench/gpu/twin.py, tests/test_gpu_twin.py): Python
# 3.12 with the JAX the lent GPUs run and its CUDA plugin. Compiling needs no CUDA library, so
# none is installed (~1 GB against ~4.3 GB with them). pyenv's python3.12 is found where PATH has
# none.
PY312 ?= $(shell command -v python3.12 >/dev/null 2>&1 && python3.12 -c '' 2>/dev/null \
	&& echo python3.12 || ls -d "$$(pyenv root 2>/dev/null)"/versions/3.12*/bin/python3.12 \
	2>/dev/null | tail -n 1)
GPU_JAX := 0.11.2
GPU_VENV := .venv-gpu
# The oracle extra (torch, timm) is ~5.5 GB from this machine's local wheel cache; the iree
# extra (IREE's compiler and runtime) is what tests/test_iree.py runs renders on.
EXTRAS_TEST := oracle,dev,iree,nvimgcodec
# No byte-compiling at install: torch alone ships thousands of modules the suite never imports
# (the extras' install 68 s -> 52 s here); Python compiles what is imported, once, on first use.
PIP_FLAGS := -q --no-compile
DEMO_NETS := resnet50 mnv4

.PHONY: demo demo-ties certify pictures test test-fast test-all lint bench gpu-twin clean

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip

$(VENV)/.installed-base: pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install $(PIP_FLAGS) -e .
	touch $@

$(VENV)/.installed-test: pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install $(PIP_FLAGS) -e '.[$(EXTRAS_TEST)]'
	touch $@ $(VENV)/.installed-base $(VENV)/.installed-dev

$(VENV)/.installed-dev: pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install $(PIP_FLAGS) -e '.[dev]'
	touch $@ $(VENV)/.installed-base

# The main job: MobileNetV4 trained data-parallel (4 replicas) on the embedded digits with its
# tied step (and its curves drawn), the op library's certification, then the data-parallel step tied to the
# single-device step for each net and loss (verdict lines).
# The recipe clips the global gradient norm at 1.0 (`clip`, timm's --clip-grad 1) and leaves BN's
# γ, β and the biases out of weight decay (`wx`, timm's default). MobileNetV4 starts at a loss of
# about 8 (its classifier initialised as timm's) that the first steps at peak lr push higher; the
# clip brings it back down sooner: 96.7 % val top-1 at step 60 where mnv4in_adamdp16 reaches
# 89.7 %, in the same time (docs/training.md#data).
DEMO_RUN := .demo/digits
# The command every target below runs: `make demo-ties TWINSTEP=...` (tests/test_demo.py) swaps it.
TWINSTEP ?= $(BIN)/twinstep
demo: $(VENV)/.installed-base
	rm -rf $(DEMO_RUN)
	$(TWINSTEP) train mnv4in_adamdp16wxclip --data digits --replicas 4 --steps 60 \
		--eval-every 20 --out $(DEMO_RUN)
	$(TWINSTEP) plot $(DEMO_RUN)
	$(TWINSTEP) certify
	@$(DEMO_TIES)

# Each tie's verdict (its report's last line) under its net and loss; every tie runs, and any that
# is not tied — NOT tied (exit 1), inconclusive (exit 4) or an error — fails the target with one
# line naming each (net, loss, verdict). A tie's stderr passes through.
DEMO_TIES = failed=; for net in $(DEMO_NETS); do for loss in ce bce; do \
		echo "== twinstep tie $$net --loss $$loss"; \
		out=$$($(TWINSTEP) tie $$net --loss $$loss); rc=$$?; \
		printf '%s\n' "$$out" | tail -n 1; \
		case $$rc in 0) verdict= ;; 1) verdict="NOT tied" ;; 4) verdict=inconclusive ;; \
			*) verdict=error ;; esac; \
		[ -z "$$verdict" ] || failed="$$failed$${failed:+; }$$net --loss $$loss: $$verdict (exit $$rc)"; \
	done; done; \
	[ -z "$$failed" ] || { echo "make demo: not every tie is tied: $$failed" >&2; exit 1; }
demo-ties: $(VENV)/.installed-base
	@$(DEMO_TIES)

certify: $(VENV)/.installed-base
	$(TWINSTEP) certify

# The README's two pictures: MobileNetV4's default tie (R = 4, f64), and the same tie with the
# shard-gamma control, which must fail (exit 1) and shows where: only BN gammas break.
PICTURES := docs/img
pictures: $(VENV)/.installed-base
	mkdir -p $(PICTURES)
	$(TWINSTEP) tie mnv4 --plot $(PICTURES)/tie-mnv4.png
	$(TWINSTEP) tie mnv4 --control shard-gamma --plot $(PICTURES)/tie-mnv4-shard-gamma.png; \
		test $$? -eq 1

# The suite's three tiers select by marker (pyproject.toml; tests/conftest.py says what each
# marker means). Every run gets its own persistent JAX compilation cache, shared by all of its
# pytest processes (the workers, the CLI tests' subprocesses): a program compiled again — after
# conftest drops compiled programs to bound memory, or in another process — is loaded instead.
# It has no size bound: with one JAX locks the cache but also scans every entry on each write,
# which made the suite 3.8 min longer; without one a worker can read another's half-written
# entry, which JAX reports ("Error -5 while decompressing data") and compiles instead.
# Two workers: compiling is single-threaded, and this machine has two cores.
PYTEST = cache=$$(mktemp -d "$${TMPDIR:-/tmp}/twinstep-jax-cache.XXXXXX"); \
	trap 'rm -rf "$$cache"' EXIT; \
	JAX_COMPILATION_CACHE_DIR=$$cache JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=0 \
	JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES=0 $(BIN)/python -m pytest
WORKERS ?= 2
# More pytest arguments, e.g. `make test ARGS="-x -k tie"` or ARGS=--durations=0.
ARGS ?=

# The tiers' marker expressions (pytest -m). tests/tiers.py reads these two lines to generate
# the README's table of what each tier runs.
FAST_MARKERS := not slow and not oracle and not iree and not nvimgcodec and not gpu_twin and not process and not all
TEST_MARKERS := not all

# The inner loop: no whole-network compile, no extra's library needed.
test-fast: $(VENV)/.installed-dev
	$(BIN)/ruff check twinstep tests bench
	$(PYTEST) -q -n $(WORKERS) -m "$(FAST_MARKERS)" $(ARGS)

# What CI runs: every claim of the suite once, in its smallest configuration.
test: $(VENV)/.installed-test $(GPU_VENV)/.installed
	$(BIN)/ruff check twinstep tests bench
	$(PYTEST) -q -n $(WORKERS) -m "$(TEST_MARKERS)" --dist loadgroup --durations=20 $(ARGS)

# The pre-release check: the complete matrix and the sweeps at full budget.
test-all: $(VENV)/.installed-test $(GPU_VENV)/.installed
	$(BIN)/ruff check twinstep tests bench
	export TWINSTEP_HYPOTHESIS=all; $(PYTEST) -q -n $(WORKERS) --dist loadgroup --durations=20 $(ARGS)

lint: $(VENV)/.installed-test
	$(BIN)/ruff check twinstep tests bench

$(VENV)/.installed-bench: pyproject.toml $(VENV)/.installed-test
	$(BIN)/python -m pip install $(PIP_FLAGS) -e '.[$(EXTRAS_TEST),bench]'
	touch $@

# The speed tables (bench/RESULTS.md, bench/peers.png): the whole DP train step against the Flax
# NNX peer and timm + torch, then XLA:CPU's levers and sync-BN's overhead, then the data pipeline
# against timm's loader. About an hour here.
bench: $(VENV)/.installed-bench
	$(BIN)/python bench/peers.py
	$(BIN)/python bench/levers.py
	$(BIN)/python bench/loader.py

$(GPU_VENV)/.installed: pyproject.toml
	$(PY312) -m venv $(GPU_VENV)
	$(GPU_VENV)/bin/python -m pip install -q --upgrade pip
	$(GPU_VENV)/bin/python -m pip install $(PIP_FLAGS) jax==$(GPU_JAX) jaxlib==$(GPU_JAX)
	$(GPU_VENV)/bin/python -m pip install $(PIP_FLAGS) --no-deps jax-cuda13-plugin==$(GPU_JAX) \
		jax-cuda13-pjrt==$(GPU_JAX)
	$(GPU_VENV)/bin/python -m pip install $(PIP_FLAGS) -e .
	touch $@
gpu-twin: $(GPU_VENV)/.installed
	$(GPU_VENV)/bin/python bench/gpu/twin.py --ab --measured bench/leases/2026-12-05-h100 $(ARGS)

clean:
	rm -rf $(VENV) $(GPU_VENV) .pytest_cache .hypothesis
