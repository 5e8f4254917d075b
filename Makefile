# KV Cache from Scratch: set-up, tests and the book.
#   make book   builds the HTML book into _build/html (warnings are errors)
#   make test   kvlib's unit tests, nbval on every notebook, and the grading tests
# Both create .venv and install the pinned requirements first (once; again when they change).

PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
NOTEBOOKS := notebooks solutions
NBVAL_FLAGS := --nbval --nbval-sanitize-with .nbval_sanitize.cfg --nbval-cell-timeout=600

.PHONY: install test test-gpu unit nbval grading book outputs clean

install: $(STAMP)

$(STAMP): requirements.txt pyproject.toml
	$(PYTHON) -c 'import sys; assert sys.version_info >= (3, 10), "Python 3.10+ is required, found " + sys.version'
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -r requirements.txt
	$(BIN)/python -m pip install --quiet --no-deps -e .
	touch $@

test: unit nbval grading

unit: $(STAMP)
	$(BIN)/python -m pytest tests -m "not gpu" --ignore=tests/test_grading.py

nbval: $(STAMP)
	$(BIN)/python -m pytest $(NBVAL_FLAGS) $(NOTEBOOKS)

grading: $(STAMP)
	$(BIN)/python -m pytest tests/test_grading.py

# On a machine with a CUDA GPU: the compiled-kernel tests (bf16, large shapes), then the benchmark.
test-gpu: $(STAMP)
	$(BIN)/python -m pytest tests -m gpu
	$(BIN)/python -m kvlib.bench decode --out results/decode_bench.csv

book: $(STAMP)
	$(BIN)/jupyter-book build . -W --keep-going

# Re-execute the chapter and solution notebooks in place, refreshing their stored outputs
# (run after editing a notebook or kvlib; nbval then checks those outputs in CI).
outputs: $(STAMP)
	$(BIN)/python -m kvlib.notebook $(NOTEBOOKS)

clean:
	rm -rf _build .pytest_cache
