"""Medusa-1 and Hydra draft heads over a frozen backbone ("Medusa: Simple LLM Inference
Acceleration Framework with Multiple Decoding Heads", arXiv:2401.10774; "Hydra:
Sequentially-Dependent Draft Heads for Medusa Decoding", arXiv:2402.05109): the heads and their
losses (`model`), the head folder (`head`), the named default trees (`trees`), the drafter
(`drafter`) and the two entries in the table of methods (`METHOD`, `HYDRA_METHOD`), which share
all of it: a head folder's method (`medusa` or `hydra`) is its arch."""

import functools

from mtpkit.models.medusa.drafter import MedusaDraftConfig, MedusaDrafter
from mtpkit.models.medusa.head import HEAD_FILES, HEAD_WEIGHTS, load_head, model_card, read_settings, save_head
from mtpkit.models.medusa.model import ARCHS, MedusaConfig, MedusaHeads, anchor_rows, collate_rows
from mtpkit.models.medusa.trees import MC_SIM_7B_63, NAMED_TREES, choose_tree
from mtpkit.models.method import Method

METHOD = Method(
    name="medusa",
    summary="trained Medusa-1 heads: residual blocks on the last hidden state, a chain or tree of their top-k "
            "(train/medusa.py --arch medusa)",
    options=MedusaDraftConfig, drafter=functools.partial(MedusaDrafter, arch="medusa"),
    config=MedusaConfig, head_files=HEAD_FILES, save_head=save_head, load_head=load_head, card=model_card)

HYDRA_METHOD = Method(
    name="hydra",
    summary="trained Hydra heads: each also reads the tokens drafted before it (train/medusa.py --arch hydra)",
    options=MedusaDraftConfig, drafter=functools.partial(MedusaDrafter, arch="hydra"),
    config=MedusaConfig, head_files=HEAD_FILES, save_head=save_head, load_head=load_head, card=model_card)

__all__ = ["MedusaDraftConfig", "MedusaDrafter", "HEAD_FILES", "HEAD_WEIGHTS", "load_head", "model_card",
           "read_settings", "save_head", "ARCHS", "MedusaConfig", "MedusaHeads", "anchor_rows", "collate_rows",
           "MC_SIM_7B_63", "NAMED_TREES", "choose_tree", "METHOD", "HYDRA_METHOD"]
