# The set-up commands: `make demo`, `make test` (CI also runs `make test-slow`) and, on a GPU
# machine, `make test-gpu`.
# All create .venv when missing.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip --disable-pip-version-check
STAMP  := $(VENV)/.installed-$(shell cat pyproject.toml constraints.txt | cksum | cut -d' ' -f1)

DOCS_STAMP := $(VENV)/.docs-$(shell cat pyproject.toml constraints.txt | cksum | cut -d' ' -f1)

.PHONY: demo lint test test-slow test-gpu gpu-check install clean docs docs-serve bytecode

$(PY):
	$(PYTHON) -m venv $(VENV)

$(STAMP): $(PY) pyproject.toml constraints.txt
	$(PIP) install -q -c constraints.txt -e '.[test]'
	rm -f $(VENV)/.installed-* && touch $(STAMP)

install: $(STAMP)

# Every process a test starts imports ddpkit: compiled once here, not again in each of them
# (0.6 s of CPU a process where PYTHONDONTWRITEBYTECODE is set, as on this project's machines).
bytecode: $(STAMP)
	$(PY) -m compileall -q src tests >/dev/null

demo: $(STAMP)
	$(VENV)/bin/ddpkit demo

# The linters first (seconds): ruff's rules and format over src and tests, mypy over the packages
# [tool.mypy] names; then every test not marked slow.
lint: $(STAMP)
	$(VENV)/bin/ruff check src tests
	$(VENV)/bin/ruff format --check src tests
	$(VENV)/bin/mypy

test: lint bytecode
	$(PY) -m pytest -m "not slow" --durations=25 $(PYTEST_ARGS)

# The long multi-process runs (repeated exit checks beside a busy core, restarts, default timeouts).
test-slow: bytecode
	$(PY) -m pytest -m slow --durations=25 $(PYTEST_ARGS)

# Every CUDA/NCCL test (marker `gpu`). Refuses to run where torch sees no GPU, so an all-skipped
# run never passes for a GPU check; -rs lists what still skipped (e.g. tests needing 2 GPUs).
test-gpu: $(STAMP)
	@$(PY) -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else \
		'make test-gpu: torch ' + torch.__version__ + ' sees no CUDA GPU (CPU wheel, or no driver)')"
	$(PY) -m pytest -m gpu -rs $(PYTEST_ARGS)

# The prepared GPU check (benchmarks/gpu_check.py): the gpu tests, micro-shards bitwise on one GPU,
# the DDP and DDP+AMP bench rows, in at most 8 minutes. No venv and no install: the machine's own
# python3 with CUDA torch and pytest, ddpkit from src. Writes $$OUT/gpu-check.md (else runs/gpu-check).
gpu-check:
	PYTHONPATH=src python3 benchmarks/gpu_check.py

$(DOCS_STAMP): $(STAMP)
	$(PIP) install -q -c constraints.txt -e '.[docs]'
	rm -f $(VENV)/.docs-* && touch $(DOCS_STAMP)

# The manual, into site/, in strict mode: a warning (a broken link or reference, a docstring that
# does not render) fails the build. docs/conf.py says what "strict" lets through.
docs: $(DOCS_STAMP)
	rm -rf site
	$(PY) -m sphinx -W -n --keep-going -q -b html docs site

docs-serve: docs
	$(PY) -m http.server --directory site 8000

clean:
	rm -rf $(VENV) runs .pytest_cache site
