# stepfs: `make demo` and `make test` work on a fresh Debian machine as root.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin

.PHONY: deps venv demo test test-fast bench clean

deps:
	@bash docker/install-system-deps.sh

# The install is quiet: pip's and setuptools' output goes to $(VENV)/install.log,
# shown only if the install fails, so `make demo` shows the demo alone.
$(BIN)/stepfs: pyproject.toml
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	@$(BIN)/python -m pip install -q --upgrade pip >$(VENV)/install.log 2>&1 || true
	@$(BIN)/python -m pip install -q -e '.[test]' >>$(VENV)/install.log 2>&1 \
	  || { cat $(VENV)/install.log >&2; echo "make: installing stepfs into $(VENV) failed; the log above is $(VENV)/install.log" >&2; exit 1; }
	@touch $@

venv: $(BIN)/stepfs

demo: deps venv
	@bash scripts/demo.sh

test: deps venv
	$(BIN)/python -m pytest -q -ra

# The benchmark suite (not part of `make test`; root; minutes): stepfs against
# native, kernel overlayfs, fuse-overlayfs and a bare mfusepy passthrough.
# `make bench BENCH_ARGS=--quick` for a shorter run; see bench/README.md.
BENCH_ARGS ?=
bench: deps venv
	@bash bench/install-deps.sh $(BIN)/python
	$(BIN)/python bench/run.py $(BENCH_ARGS)

# Store and overlay core only: no kernel, no mounts.
test-fast: venv
	$(BIN)/python -m pytest -q -m "not mount"

clean:
	rm -rf $(VENV) demo-work .pytest_cache *.egg-info
