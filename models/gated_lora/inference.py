"""Gated LoRA for decoding: the lean inference form of the gated linear layers.

`to_inference` swaps every peft LoRA layer of a trained `GatedMTP` for a `GatedLoRALinear`
(three tensor ops instead of peft's layer and two hooks); decoding only, never trained.
"""

from __future__ import annotations

import torch
from torch import nn

from mtpkit.models.gated_lora.model import Gate, GatedMTP


class GatedLoRALinear(nn.Module):
    """Inference form of one gated LoRA linear (decoding only, never trained):

        y = W x;   y[gated rows] += x[gated rows] A^T (alpha / r) B^T

    Same weights as peft's layer (the scaling folded into B^T, so gated rows agree to rounding),
    3 tensor ops where peft takes ~12 plus two hooks: on a CPU a 30-layer model has 210 of these
    per forward, so the difference is measurable. Decoding gates a contiguous suffix of a
    batch-1 forward, added in place with one addmm. Ungated rows are W x exactly, as in the
    training form.

    Over a packed base (`pack_linears`) it is computed by a `PackedGroup`: alone, one product on
    [W; A]; fused with its siblings, one product for all of them."""

    def __init__(self, base: nn.Linear, A: torch.Tensor, B: torch.Tensor, scaling: float, gate: Gate):
        super().__init__()
        self.base, self.gate = base, gate
        dtype = base.weight.dtype  # the target's (a bfloat16 target decodes with a bfloat16 adapter)
        self.register_buffer("At", A.detach().t().to(dtype).contiguous())  # [in, r]
        self.register_buffer("Bt", (B.detach().t().float() * scaling).to(dtype).contiguous())  # [r, out]
        self.group = self.siblings = None  # set by `PackedGroup` once the base is packed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.group is None:
            return self.unpacked(x)
        return self.group(x, self)

    def unpacked(self, x: torch.Tensor) -> torch.Tensor:
        """W x from the base, and the gated rows' delta as products of their own."""
        y = self.base(x)
        span = self.gate.span
        if span is not None and x.dim() == 3 and x.shape[0] == 1 and not torch.is_grad_enabled():
            s, e = span
            y[0, s:e].addmm_(x[0, s:e] @ self.At, self.Bt)
        elif self.gate.rows is not None and self.gate.rows.numel():
            y = y + self.gate.scatter(self.gate.select(x) @ self.At @ self.Bt, x)
        return y


def to_inference(model: GatedMTP) -> GatedMTP:
    """Swap every peft LoRA layer of `model` for a `GatedLoRALinear` (in place; decoding only:
    the model can no longer be trained or saved as a peft adapter)."""
    from peft.tuners.lora import LoraLayer

    swaps = [(name, module) for name, module in model.peft.get_base_model().named_modules()
             if isinstance(module, LoraLayer)]
    root = model.peft.get_base_model()
    for name, module in swaps:
        parent_name, _, child = name.rpartition(".")
        adapter = module.active_adapters[0]
        lean = GatedLoRALinear(module.base_layer, module.lora_A[adapter].weight, module.lora_B[adapter].weight,
                               module.scaling[adapter], model.gate)
        setattr(root.get_submodule(parent_name) if parent_name else root, child, lean)
    return model.eval()
