"""MTPC, probabilistic-circuit heads over the next n bytes ("Fast and Expressive Multi-Byte
Prediction with Probabilistic Circuits", arXiv:2511.11346): the native circuits (`circuits`), the
training head and model (`model`), the head folder (`head`), the decode-only kernels (`decode`),
the drafter (`drafter`) and its draft trees (`draft_trees`), libcirkit heads (`cirkit_head`,
`circuit_cirkit`; imported on use) and the entry in the table of methods (`METHOD`)."""

from mtpkit.models.method import Method
from mtpkit.models.mtpc.drafter import MTPCDraftConfig, MTPCDrafter
from mtpkit.models.mtpc.head import HEAD_FILES, HEAD_WEIGHTS, load_head, model_card, save_head
from mtpkit.models.mtpc.model import MTPCConfig, MTPCHead, MTPCModel, window_loss, window_targets

METHOD = Method(
    name="mtpc",
    summary="MTPC circuit heads over a byte-level target (train/mtpc.py), Algorithm 2",
    options=MTPCDraftConfig, drafter=MTPCDrafter,
    config=MTPCConfig, head_files=HEAD_FILES, save_head=save_head, load_head=load_head, card=model_card)

__all__ = ["MTPCDraftConfig", "MTPCDrafter", "HEAD_FILES", "HEAD_WEIGHTS", "load_head", "model_card", "save_head",
           "MTPCConfig", "MTPCHead", "MTPCModel", "window_loss", "window_targets", "METHOD"]
