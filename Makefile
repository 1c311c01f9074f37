# The two commands of the README: `make run` (main job) and `make test`. Both create the
# virtual environment on first use; they need only Python 3.10+ with pip and venv.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
NPROC  ?= 4
SPEC   ?= specs/tiny_cpu.ppspec

.PHONY: run test check bench clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	# the CPU build of torch, pinned: a bare `torch` requirement can pull a multi-GB CUDA build
	$(BIN)/python -m pip install -q "torch==2.13.0"
	$(BIN)/python -m pip install -q -e ".[runtime,test]"
	touch $(STAMP)

run: $(STAMP)
	$(BIN)/ppdsl check specs/*.ppspec
	OMP_NUM_THREADS=1 $(BIN)/ppdsl run $(SPEC) --nproc $(NPROC)

test: $(STAMP)
	$(BIN)/python -m pytest -q tests

check: $(STAMP)
	$(BIN)/ppdsl check specs/*.ppspec

bench: $(STAMP)
	$(BIN)/python benchmarks/bench_check.py
	$(BIN)/python benchmarks/bench_schedule.py

clean:
	rm -rf $(VENV) runs .pytest_cache
