"""The table of methods: one `Method` entry per name, read by the trainers, `train/export.py`
and `eval/bench.py` (which know no method by name beyond `ar`, the baseline).

A method's entry lives in its home (`mtpkit.models.gated_lora`, `mtpkit.models.mtpc`,
`mtpkit.models.medusa`, `mtpkit.models.probe`, `mtpkit.models.pld`); this file only lists them.
To add a method: give it a home with its options dataclass, drafter and (if trained) save_head /
load_head / card, and add its entry here.
"""

from __future__ import annotations

from dataclasses import dataclass

from mtpkit.models import gated_lora, medusa, mtpc, pld, probe
from mtpkit.models.decoding.drafter import Drafter, StockAR
from mtpkit.models.decoding.step import StepOptions
from mtpkit.models.method import Method


@dataclass
class NoOptions:
    pass


@dataclass
class AROptions(StepOptions):
    pass


@dataclass
class HFAROptions:
    compile: bool = False
    """1: transformers' fastest path, its static KV cache with the forward under torch.compile
    (CUDA graphs on a GPU); the first call compiles (seconds on a GPU, a minute or more on a CPU:
    reported apart as compile_s). The fair peer of mtpkit's AR"""


@dataclass
class HFPLDOptions:
    num: int = 10
    """prompt_lookup_num_tokens (as pld's draft_len)"""
    ngram: int = 2
    """max_matching_ngram_size (as pld's ngram_max)"""


METHODS: dict[str, Method] = {
    "ar": Method("ar", "plain autoregressive decoding through the mtpkit decoder (the baseline)", AROptions,
                 drafter=lambda options: Drafter()),
    "ar_stock": Method("ar_stock", "the same on torch's stock kernels (the reference for packed kernels)", NoOptions,
                       drafter=lambda options: StockAR()),
    "pld": pld.METHOD,
    "probe": probe.METHOD,
    "gated_lora": gated_lora.METHOD,
    "mtpc": mtpc.METHOD,
    "medusa": medusa.METHOD,
    "hydra": medusa.HYDRA_METHOD,
    "hf_ar": Method("hf_ar", "transformers' own generate() (peer baseline, no tau); compile=1: its static cache "
                             "+ torch.compile", HFAROptions, generate_kwargs=lambda options: {}),
    "hf_pld": Method("hf_pld", "transformers' generate() with prompt lookup", HFPLDOptions,
                     generate_kwargs=lambda o: {"prompt_lookup_num_tokens": o.num, "max_matching_ngram_size": o.ngram}),
}


def trained_method(name: str) -> Method:
    """The entry of a method with a trained head (the `method` of a head's mtpkit_config.json)."""
    method = METHODS.get(name)
    if method is None or method.save_head is None:
        known = ", ".join(m.name for m in METHODS.values() if m.save_head is not None)
        raise ValueError(f"unknown head method {name!r}; known: {known}")
    return method
