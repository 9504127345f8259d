"""The row type of the table of methods (`Method`, listed in `mtpkit.models.registry`) and what a
method says about one of its heads on the exported model card (`ModelCard`)."""

from __future__ import annotations

import dataclasses
from typing import Callable


@dataclasses.dataclass(frozen=True)
class ModelCard:
    """What a method says about one of its heads on the exported model card."""
    title: str
    about: str
    settings: dict
    usage: str
    """Python lines that load the head (after `model, tokenizer = load_backbone(...)`)"""
    bench: str = ""
    """an `eval/bench.py --methods` spec using the head, or ''"""
    library: str = "mtpkit"
    """the card's `library_name`"""


@dataclasses.dataclass(frozen=True)
class Method:
    """One row of the table of methods (`mtpkit.models.registry.METHODS`), read by the trainers,
    `train/export.py` and `eval/bench.py`."""
    name: str
    summary: str
    """one line for `eval/bench.py --help`"""
    options: type
    """dataclass of the bench options (`name:key=value,...`)"""
    drafter: Callable | None = None
    """options -> a `Drafter`; None for a baseline that is not a drafter (transformers' generate)"""
    config: type | None = None
    """dataclass of a trained head's settings (its trainer's `model:` section, saved in mtpkit_config.json)"""
    head_files: tuple[str, ...] = ()
    """files of an exported head folder (besides mtpkit_config.json); () = no trained head"""
    save_head: Callable | None = None
    """(model, folder, base_model, extra=None, state_dict=None) -> None; refuses non-finite weights"""
    load_head: Callable | None = None
    """(folder, backbone, trust_remote_code=False) -> the trained model on `backbone`; refuses
    non-finite weights, and a head whose config names code to run unless trust_remote_code"""
    card: Callable[[dict], ModelCard] | None = None
    """head config -> its model card's text"""
    generate_kwargs: Callable | None = None
    """options -> extra keyword arguments of transformers' generate() (baselines without a drafter)"""
