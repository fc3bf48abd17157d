# remat: `make demo` installs everything and runs the main job; `make test` installs and runs the tests.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
# Pinned CPU build of PyTorch (an unpinned torch pulls several GB of CUDA packages).
TORCH  ?= torch==2.13.0
# Stable CPU timings (NOTE [ Timing environment ] in src/remat/cli/main.py, which the `remat` program
# applies to itself): keep freed memory in the process, and let idle OpenMP threads sleep instead of
# spinning on cores that other processes need.
BENCH_ENV := MALLOC_MMAP_THRESHOLD_=33554432 MALLOC_TRIM_THRESHOLD_=17179869184 MALLOC_TOP_PAD_=0 OMP_WAIT_POLICY=PASSIVE

.PHONY: install demo bench test lint clean

# The test dependencies (transformers, peft) must not move torch off the pinned build: it is a constraint.
$(VENV)/.installed: pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet "$(TORCH)"
	printf '%s\n' "$(TORCH)" > $(VENV)/constraints.txt
	$(PY) -m pip install --quiet -e ".[dev]" -c $(VENV)/constraints.txt
	touch $@

install: $(VENV)/.installed

demo: install
	$(BENCH_ENV) $(VENV)/bin/remat bench gpt --budget 30% --budget 50% --budget 70% --json bench.json

bench: demo

test: install
	$(BENCH_ENV) $(PY) -m pytest -q

lint: install
	$(VENV)/bin/ruff check src tests benchmarks
	$(VENV)/bin/mypy src

clean:
	rm -rf $(VENV) build *.egg-info src/*.egg-info bench.json
