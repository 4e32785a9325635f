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

test: $(VENV)/.installed-test
	$(BIN)/ruff check twinstep tests bench
	$(BIN)/python -m pytest -q

lint: $(VENV)/.installed-test
	$(BIN)/ruff check twinstep tests bench

bench: $(VENV)/.installed-test
	$(BIN)/python bench/step.py

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
