"""Gated-LoRA mask-token MTP ("Your LLM Knows the Future: Uncovering Its Multi-Token Prediction
Potential", Samragh et al., arXiv:2507.11851): the training model (`model`), the head folder
(`head`), the lean decode-only layers (`inference`), the drafter (`drafter`) and its entry in the
table of methods (`METHOD`)."""

from mtpkit.models.gated_lora.drafter import DECODINGS, GatedLoRADraftConfig, GatedLoRADrafter
from mtpkit.models.gated_lora.head import HEAD_FILES, HEAD_WEIGHTS, load_head, model_card, save_head
from mtpkit.models.gated_lora.inference import GatedLoRALinear, to_inference
from mtpkit.models.gated_lora.model import LLAMA_LINEARS, Gate, GatedLoRAConfig, GatedMTP, SamplerMLP
from mtpkit.models.method import Method

METHOD = Method(
    name="gated_lora",
    summary="trained gated-LoRA mask tokens (train/gated_lora.py)",
    options=GatedLoRADraftConfig, drafter=GatedLoRADrafter,
    config=GatedLoRAConfig, head_files=HEAD_FILES, save_head=save_head, load_head=load_head, card=model_card)

__all__ = ["DECODINGS", "GatedLoRADraftConfig", "GatedLoRADrafter", "HEAD_FILES", "HEAD_WEIGHTS", "load_head",
           "model_card", "save_head", "GatedLoRALinear", "to_inference", "LLAMA_LINEARS", "Gate", "GatedLoRAConfig",
           "GatedMTP", "SamplerMLP", "METHOD"]
