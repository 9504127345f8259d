"""Loading a real EvaByte checkpoint (a Hub id or a folder, with its own remote code) under
transformers 5.x. EvaByte's code (github.com/OpenEvaByte/evabyte `evabyte_hf/`, written for
transformers 4.47) breaks in five places there; mtpkit patches the loaded config and model
objects, never the checkpoint's files, and logs each change once per process:

- `_init_rope` reads `config.rope_scaling["type"]`: 5.x turns `rope_scaling: null` into a
  `rope_parameters` dict ({"rope_type": "default", ...}) that `rope_scaling` returns, so building
  the model raises KeyError 'type'. Fix: `rope_parameters = None` when it is that default (the
  model reads `rope_theta` itself).
- The Hub config's `use_cache: true` makes a bare `model(ids)` fail ("during decoding we must
  explicitly pass position_ids") and `return_dict: false` makes it return tuples. Fix: False and
  True (a forward without a cache still builds EvaByte's own `EvaCache` inside, in eval mode).
- The rotary tables are non-persistent buffers made in `__init__`, which `from_pretrained` builds
  on the meta device: they come back uninitialised (whatever the memory held: NaN, or finite
  garbage). Fix: `model.model._init_rope()` rebuilds them on the model's device.
- `_tied_weights_keys` is a list (`["lm_head.weight"]`); 5.x expects a dict {tied: source} and
  `save_pretrained` crashes on the list. EvaByte does not tie its LM head
  (`tie_word_embeddings: false`): Fix: an empty dict on the instance, or `{"lm_head.weight":
  "model.embed_tokens.weight"}` when the config ties them.
- No `GenerationMixin`, hence no `generation_config` (mtpkit reads its eos ids; EvaByte's
  `multi_byte_generate` reads it too). transformers' Auto class adds the mixin to a remote class
  the first time a process loads it, but not on later loads (the class is registered by then).
  Fix: a `generation_config` built from the config when there is none.
`EvaByteModel.forward` reading `input_ids.shape` when given only `inputs_embeds` needs no patch:
the decoder's body for EvaByte (`mtpkit.models.evabyte.eva.EvaBody`) runs embeddings itself.
"""

from __future__ import annotations

import logging

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig

logger = logging.getLogger(__name__)
_logged: set[str] = set()


def _note(changes: list[str], fix: str, what: str) -> None:
    """Record a change; log it the first time this process makes that fix."""
    changes.append(what)
    if fix not in _logged:
        _logged.add(fix)
        logger.warning("[mtpkit] EvaByte under transformers 5.x: %s", what)


def _rope(config, changes: list[str]) -> None:
    rope = getattr(config, "rope_parameters", None)
    if isinstance(rope, dict) and "type" not in rope and rope.get("rope_type", "default") == "default":
        config.rope_parameters = None  # what `rope_scaling: null` meant: `_init_rope`'s plain rotary
        _note(changes, "rope", "rope_parameters (5.x's form of rope_scaling: null) set to None, so _init_rope "
                       "builds the plain rotary embedding instead of raising KeyError 'type'")


def _use_cache(config, changes: list[str]) -> None:
    if getattr(config, "use_cache", False):
        config.use_cache = False
        _note(changes, "use_cache", "config.use_cache set to False (a bare forward with it on needs explicit "
                                    "position ids)")


def _return_dict(config, changes: list[str]) -> None:
    if getattr(config, "return_dict", True) is False:
        config.return_dict = True
        _note(changes, "return_dict", "config.return_dict set to True (forward returned tuples)")


def _rotary(model, changes: list[str]) -> None:
    body = model.get_decoder()
    old = body.rotary_emb.cos_cached.detach().clone()
    body._init_rope()
    body.rotary_emb.to(model.get_input_embeddings().weight.device)
    new = body.rotary_emb.cos_cached
    if old.shape != new.shape or not torch.equal(old.to(new), new):
        wrong = int((old.to(new) != new).sum()) if old.shape == new.shape else old.numel()
        _note(changes, "rotary", f"rotary tables rebuilt with model.model._init_rope() (after loading, {wrong} of "
                                 f"their {new.numel()} cosines were not the computed ones)")


def _tied_weights(model, changes: list[str]) -> None:
    if isinstance(getattr(model, "_tied_weights_keys", None), list):
        tied = getattr(model.config, "tie_word_embeddings", False)
        model._tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"} if tied else {}
        _note(changes, "tied_weights", f"_tied_weights_keys (a list, which 5.x's save_pretrained cannot take) set to "
                       f"{model._tied_weights_keys}")


def _generation_config(model, changes: list[str]) -> None:
    if getattr(model, "generation_config", None) is None:
        model.generation_config = GenerationConfig.from_model_config(model.config)
        _note(changes, "generation_config", "generation_config built from the config (EvaByte has no GenerationMixin)")


CONFIG_FIXES = {"rope": _rope, "use_cache": _use_cache, "return_dict": _return_dict}
"""applied to the config before the model is built (name -> fix(config, changes))"""
MODEL_FIXES = {"rotary": _rotary, "tied_weights": _tied_weights, "generation_config": _generation_config}
"""applied to the built model (name -> fix(model, changes))"""


def fix_config(config) -> list[str]:
    """Patch an EvaByte config before the model is built; the changes made, as sentences."""
    changes: list[str] = []
    for fix in CONFIG_FIXES.values():
        fix(config, changes)
    return changes


def fix_model(model) -> list[str]:
    """Patch a built EvaByte model (see the module docstring); the changes made, as sentences."""
    changes: list[str] = []
    for fix in MODEL_FIXES.values():
        fix(model, changes)
    return changes


def load_evabyte(name_or_folder, dtype: torch.dtype, trust_remote_code: bool):
    """(model, tokenizer) of an EvaByte checkpoint with its remote code, fixed for 5.x."""
    config = AutoConfig.from_pretrained(name_or_folder, trust_remote_code=trust_remote_code)
    fix_config(config)
    model = AutoModelForCausalLM.from_pretrained(name_or_folder, config=config, dtype=dtype,
                                                 trust_remote_code=trust_remote_code)
    fix_model(model)
    tokenizer = AutoTokenizer.from_pretrained(name_or_folder, trust_remote_code=trust_remote_code)
    return model, tokenizer
