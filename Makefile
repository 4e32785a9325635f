# Two commands on a fresh machine: `make demo` and `make test`. Each creates .venv when it is
# missing and installs into it only when pyproject.toml is newer than the last install.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
# The oracle extra (torch, timm) is ~5.5 GB from this machine's local wheel cache.
EXTRAS_TEST := oracle,dev
DEMO_NETS := resnet50 mnv4

.PHONY: demo certify test lint bench clean

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip

$(VENV)/.installed-base: pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install -q -e .
	touch $@

$(VENV)/.installed-test: pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install -q -e '.[$(EXTRAS_TEST)]'
	touch $@ $(VENV)/.installed-base

# The main job: the op library's certification, then the data-parallel step tied to the
# single-device step for each net and loss (verdict lines).
demo: $(VENV)/.installed-base
	$(BIN)/twinstep certify
	@for net in $(DEMO_NETS); do for loss in ce bce; do \
		echo "== twinstep tie $$net --loss $$loss"; \
		$(BIN)/twinstep tie $$net --loss $$loss | tail -n 1 || exit 1; done; done

certify: $(VENV)/.installed-base
	$(BIN)/twinstep certify

# The heavy files (whole-network programs compiled by the hundred) each get a fresh pytest
# process: one process for the whole suite grew past CI's 24 GiB and was killed. Every file runs
# even when one fails; the exit status says whether all passed.
HEAVY_TESTS := tests/test_step.py tests/test_steps_tie.py tests/test_tie.py tests/test_render.py

test: $(VENV)/.installed-test
	$(BIN)/ruff check twinstep tests bench
	@status=0; \
	echo "== pytest tests (but $(HEAVY_TESTS))"; \
	$(BIN)/python -m pytest -q $(addprefix --ignore=,$(HEAVY_TESTS)) || status=1; \
	for f in $(HEAVY_TESTS); do echo "== pytest $$f"; \
		$(BIN)/python -m pytest -q $$f || status=1; done; \
	exit $$status

lint: $(VENV)/.installed-test
	$(BIN)/ruff check twinstep tests bench

bench: $(VENV)/.installed-test
	$(BIN)/python bench/step.py

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
