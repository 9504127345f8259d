"""Gated-LoRA mask-token MTP (seed 002, Samragh et al., "Your LLM Knows the Future").

- k mask tokens with their own trainable input embeddings (random init, Sec. 2), fed through
  the backbone where token embeddings would go.
- Gated LoRA on every targeted linear layer of the decoder (Sec. 2.2):

      y_t = W x_t + I(t) * (alpha / r) * B A x_t,      I(t) = 1 only at mask positions

  built on peft (so its adapter save/load holds) with two hooks per layer: a pre-hook on the
  LoRA dropout keeps only the gated rows, a hook on `lora_B` scatters the delta back into
  zeros. Ungated rows get `W x + 0` (bit-identical to the base model) and the delta is only
  computed where it is used. The adapter is never merged.
- The sampler head (Sec. 2.3): p = W_unembed * MLP([E(y_prev); z]), the MLP two blocks of
  Linear -> SiLU -> LayerNorm from 2d to d.
- The training forward returns the Sec. 2.5 losses: base and sampler cross-entropy over NTP
  and mask positions plus the latent-consistency loss (each weighted and logged apart).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from mtpkit.data.chat import IGNORE
from mtpkit.models.packed_linear import PackedLinear, pack_rows, packed_forward

LLAMA_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass
class GatedLoRAConfig:
    k: int = 4
    """mask tokens appended after every loss-carrying token (tokens predicted ahead)"""
    rank: int = 16
    """LoRA rank r"""
    alpha: float = 32.0
    """LoRA alpha (the delta is scaled by alpha / r)"""
    dropout: float = 0.0
    """LoRA dropout on the gated rows"""
    target_modules: list[str] = field(default_factory=lambda: list(LLAMA_LINEARS))
    """decoder linear layers that get a gated LoRA (names as in peft's target_modules)"""
    sampler: bool = True
    """train the sampler MLP head"""
    base_weight: float = 1.0
    """weight of the base-head cross-entropy (NTP + mask positions)"""
    sampler_weight: float = 1.0
    """weight of the sampler-head cross-entropy (NTP + mask positions)"""
    lcm_weight: float = 1.0
    """weight of the latent-consistency loss"""


class Gate:
    """Which rows of the current forward get the LoRA delta. Outside `with gate(mask):` none do."""

    def __init__(self):
        self.rows: torch.Tensor | None = None  # flat indices of gated rows
        self.shape: torch.Size | None = None   # [B, T] of the forward
        self.span: tuple[int, int] | None = None  # (start, end) if the rows of a batch-1 forward are one run

    @contextlib.contextmanager
    def __call__(self, gate: torch.Tensor):
        """gate: [B, T] bool, True where the adapter is on (mask tokens)."""
        previous = self.rows, self.shape, self.span
        self.rows, self.shape, self.span = gate.reshape(-1).nonzero().squeeze(1), gate.shape, None
        if gate.shape[0] == 1 and self.rows.numel():  # decoding: the gated masks are the suffix
            start, end = int(self.rows[0]), int(self.rows[-1]) + 1
            self.span = (start, end) if end - start == self.rows.numel() else None
        try:
            yield
        finally:
            self.rows, self.shape, self.span = previous

    def select(self, x: torch.Tensor) -> torch.Tensor:  # [B, T, d] -> [n_gated, d]
        if self.rows is None:
            return x.new_zeros(0, x.shape[-1])
        if x.shape[:-1] != self.shape:
            raise RuntimeError(f"gated LoRA: input of shape {tuple(x.shape)} under a gate of shape "
                               f"{tuple(self.shape)}; run the forward inside `with gate(mask)` of its shape")
        return x.reshape(-1, x.shape[-1]).index_select(0, self.rows)

    def scatter(self, delta: torch.Tensor, like: torch.Tensor) -> torch.Tensor:  # -> [B, T, out]
        full = delta.new_zeros(like.shape[:-1].numel(), delta.shape[-1])
        if self.rows is not None and self.rows.numel():
            full = full.index_copy(0, self.rows, delta)
        return full.view(*like.shape[:-1], delta.shape[-1])


def add_gate_hooks(peft_model, gate: Gate) -> int:
    """Gate every peft LoRA linear of `peft_model` by `gate`; returns how many were gated."""
    from peft.tuners.lora import LoraLayer

    count = 0
    for module in peft_model.modules():
        if not isinstance(module, LoraLayer):
            continue
        for name in module.lora_A:
            inputs = {}

            def keep_gated(_, args, inputs=inputs):
                inputs["x"] = args[0]
                return (gate.select(args[0]),)

            def scatter_back(_, args, out, inputs=inputs):
                return gate.scatter(out, inputs.pop("x"))

            module.lora_dropout[name].register_forward_pre_hook(keep_gated)
            module.lora_B[name].register_forward_hook(scatter_back)
            count += 1
    if count == 0:
        raise ValueError("gated LoRA: no LoRA layer found to gate (check target_modules)")
    return count


class GatedLoRALinear(nn.Module):
    """Inference form of one gated LoRA linear (decoding only, never trained):

        y = W x;   y[gated rows] += x[gated rows] A^T (alpha / r) B^T

    Same weights as peft's layer (the scaling folded into B^T, so gated rows agree to rounding),
    3 tensor ops where peft takes ~12 plus two hooks: on a CPU a 30-layer model has 210 of these
    per forward, so the difference is measurable. Decoding gates a contiguous suffix of a
    batch-1 forward, added in place with one addmm. Ungated rows are W x exactly, as in the
    training form."""

    def __init__(self, base: nn.Linear, A: torch.Tensor, B: torch.Tensor, scaling: float, gate: Gate):
        super().__init__()
        self.base, self.gate = base, gate
        self.register_buffer("At", A.detach().t().contiguous())  # [in, r]
        self.register_buffer("Bt", (B.detach().t() * scaling).contiguous())  # [r, out]
        self.fused, self.fused_bias, self.fused_version = None, None, -1
        self.siblings = None  # set by `packed_linear.fuse_siblings`: q/k/v, gate/up as one product

    def _stacked(self, x: torch.Tensor) -> torch.Tensor:
        """[W; A] x in one oneDNN product when the base is packed (`pack_linears`): the A rows
        ride along (r of out + r outputs) instead of costing a small product of their own, and
        stacking leaves W's outputs bit-identical (tested)."""
        W, b = self.base.weight, self.base.bias
        if self.fused is None or self.fused_version != W._version:
            self.fused = pack_rows(torch.cat([W.detach(), self.At.t()]))
            self.fused_bias = None if b is None else torch.cat([b.detach(), self.At.new_zeros(self.At.shape[1])])
            self.fused_version = W._version
        return packed_forward(x, self.fused, self.fused_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.siblings is not None and self.siblings.usable(x):
            return self.siblings(x, self)
        span = self.gate.span
        fast = span is not None and x.dim() == 3 and x.shape[0] == 1 and not torch.is_grad_enabled()
        if fast and isinstance(self.base, PackedLinear) and self.base.usable(x):
            s, e = span
            both = self._stacked(x)
            out = self.base.out_features
            both[0, s:e, :out].addmm_(both[0, s:e, out:], self.Bt)
            return both[..., :out]  # a strided view: copying it out cost 2-10% of a gated step here
        y = self.base(x)
        if fast:
            s, e = span
            y[0, s:e].addmm_(x[0, s:e] @ self.At, self.Bt)
        elif self.gate.rows is not None and self.gate.rows.numel():
            y = y + self.gate.scatter(self.gate.select(x) @ self.At @ self.Bt, x)
        return y


def to_inference(model: "GatedMTP") -> "GatedMTP":
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


class SamplerMLP(nn.Module):
    """MLP([E(y_prev); z]): two blocks of Linear -> SiLU -> LayerNorm, 2d -> d -> d (Sec. 2.3)."""

    def __init__(self, d: int):
        super().__init__()
        self.blocks = nn.Sequential(nn.Linear(2 * d, d), nn.SiLU(), nn.LayerNorm(d),
                                    nn.Linear(d, d), nn.SiLU(), nn.LayerNorm(d))

    def forward(self, prev_embeds: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        return self.blocks(torch.cat([prev_embeds, hidden], dim=-1))


class GatedMTP(nn.Module):
    """Frozen backbone + gated LoRA + mask embeddings + sampler; forward = the training losses.

    `adapter` is a peft adapter folder to load instead of a fresh (random) adapter.
    """

    def __init__(self, base_model, config: GatedLoRAConfig, adapter: str | None = None, seed: int = 0):
        super().__init__()
        from peft import LoraConfig, PeftModel, get_peft_model

        if config.k < 1 or config.rank < 1:
            raise ValueError(f"gated LoRA needs k >= 1 and rank >= 1, got k={config.k}, rank={config.rank}")
        self.config = config
        for p in base_model.parameters():
            p.requires_grad_(False)
        torch.manual_seed(seed)
        if adapter is None:
            lora = LoraConfig(r=config.rank, lora_alpha=config.alpha, lora_dropout=config.dropout,
                              target_modules=list(config.target_modules), bias="none")
            self.peft = get_peft_model(base_model, lora)
        else:
            self.peft = PeftModel.from_pretrained(base_model, adapter, is_trainable=True)
        self.gate = Gate()
        add_gate_hooks(self.peft, self.gate)
        inner = self.peft.get_base_model()
        # plain references (not submodules: the backbone is registered once, under `peft`)
        self.__dict__.update(body=inner.get_decoder(), embed=inner.get_input_embeddings())
        table = self.embed.weight.detach().float()
        d = table.shape[1]
        # random vectors with the embedding table's per-dimension statistics (Sec. 2: "generated
        # as random vectors and added to the embedding table")
        init = table.mean(0) + table.std(0) * torch.randn(config.k, d)
        self.mask_embeds = nn.Parameter(init.to(self.embed.weight.dtype))  # [k, d]
        self.sampler = SamplerMLP(d).to(self.embed.weight.dtype) if config.sampler else None

    @property
    def lm_head(self) -> nn.Module:
        """The backbone's output layer, looked up on every use: `pack_linears` swaps it for a
        packed copy after this model is built, and the sampler must use that one (a stale
        reference kept the sampler's one-row LM-head calls on the slower stock kernel)."""
        return self.peft.get_base_model().get_output_embeddings()

    # ---- pieces shared by training and decoding ----
    def input_embeds(self, input_ids: torch.Tensor, mask_index: torch.Tensor) -> torch.Tensor:
        """Token embeddings, or mask i's embedding where mask_index == i (1..k). [B, T, d]"""
        tokens = self.embed(input_ids.clamp(min=0))
        masks = self.mask_embeds[(mask_index - 1).clamp(min=0)]
        return torch.where((mask_index > 0)[..., None], masks.to(tokens.dtype), tokens)

    def sampler_logits(self, prev_ids: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """W_unembed MLP([E(y_prev); z]) -> [..., V]."""
        return self.lm_head(self.sampler(self.embed(prev_ids), hidden))

    def hidden_states(self, input_ids, mask_index, position_ids, attention_mask) -> torch.Tensor:
        with self.gate(mask_index > 0):
            return self.body(inputs_embeds=self.input_embeds(input_ids, mask_index), attention_mask=attention_mask,
                             position_ids=position_ids, use_cache=False).last_hidden_state

    # Checkpoints hold only what training changes (LoRA, mask embeddings, sampler): the frozen
    # backbone is re-read from --backbone, so a checkpoint of a 135M model is ~MBs, not 540 MB.
    def state_dict(self, *args, **kwargs):
        state = super().state_dict(*args, **kwargs)
        prefix = kwargs.get("prefix", "")
        frozen = {prefix + n for n, p in self.named_parameters(remove_duplicate=False) if not p.requires_grad}
        return type(state)((k, v) for k, v in state.items() if k not in frozen)

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        missing, unexpected = super().load_state_dict(state_dict, strict=False, assign=assign)
        trainable = {n for n, p in self.named_parameters() if p.requires_grad}
        missing = [k for k in missing if k in trainable]
        if strict and (missing or unexpected):
            raise RuntimeError(f"GatedMTP.load_state_dict: missing trainable {missing[:5]}, unexpected {unexpected[:5]}")
        return torch.nn.modules.module._IncompatibleKeys(missing, unexpected)

    # ---- training forward (Sec. 2.5) ----
    def forward(self, input_ids, mask_index, position_ids, attention_mask, labels, prev_ids, ntp_slot):
        """Losses of one batch built by `mtpkit.data.mtp.collate_mask_inputs`.

        Returns {"loss": weighted total, "base_ntp", "base_mtp", "sampler_ntp", "sampler_mtp",
        "lcm", "acc_m1".."acc_mk"} (the parts detached, for logging).
        """
        hidden = self.hidden_states(input_ids, mask_index, position_ids, attention_mask)  # [B, T, d]
        return self.losses(hidden, mask_index, labels, prev_ids, ntp_slot)

    def losses(self, hidden, mask_index, labels, prev_ids, ntp_slot) -> dict[str, torch.Tensor]:
        """The Sec. 2.5 losses from last-layer hidden states [B, T, d] of a Figure-4 batch."""
        c = self.config
        valid = labels != IGNORE
        is_mask = mask_index > 0
        h = hidden[valid]                                   # [n, d]
        y = labels[valid]
        masked = is_mask[valid]
        base_ce = F.cross_entropy(self.lm_head(h).float(), y, reduction="none")
        total = c.base_weight * base_ce.mean()
        out = {"base_ntp": _mean(base_ce[~masked]), "base_mtp": _mean(base_ce[masked])}
        with torch.no_grad():
            pred = self.lm_head(h[masked]).argmax(-1) if masked.any() else y[:0]
            idx = mask_index[valid][masked]
            for i in range(1, c.k + 1):
                out[f"acc_m{i}"] = _mean((pred[idx == i] == y[masked][idx == i]).float())
        if self.sampler is not None:
            sampler_ce = F.cross_entropy(self.sampler_logits(prev_ids[valid], h).float(), y, reduction="none")
            total = total + c.sampler_weight * sampler_ce.mean()
            out.update(sampler_ntp=_mean(sampler_ce[~masked]), sampler_mtp=_mean(sampler_ce[masked]))
        # latent consistency (Eq. 1): each mask that predicts the same token as NTP position t is
        # pulled towards z_t (detached: the anchor gets no gradient); mean over S(z_t), then over t
        lcm_rows = valid & is_mask
        if lcm_rows.any():
            anchors = hidden.detach().gather(1, ntp_slot[..., None].expand_as(hidden))[lcm_rows]  # [m, d]
            dist = (hidden[lcm_rows] - anchors).pow(2).mean(-1)                                    # [m]
            flat = (ntp_slot + torch.arange(len(ntp_slot), device=ntp_slot.device)[:, None] * ntp_slot.shape[1])[lcm_rows]
            _, group, counts = torch.unique(flat, return_inverse=True, return_counts=True)
            lcm = (dist / counts[group]).sum() / counts.numel()
        else:
            lcm = hidden.sum() * 0.0
        total = total + c.lcm_weight * lcm
        out["lcm"] = lcm.detach()
        out["loss"] = total
        return out


def _mean(x: torch.Tensor) -> torch.Tensor:
    return x.detach().mean() if x.numel() else torch.tensor(float("nan"), device=x.device)


# ---- the head folder: peft adapter + mask embeddings/sampler + config ----
HEAD_CONFIG = "mtpkit_config.json"
HEAD_WEIGHTS = "mtp_head.safetensors"


def save_head(model: GatedMTP, out_dir, base_model: str, extra: dict | None = None,
              state_dict: dict | None = None) -> None:
    """Write `out_dir`: adapter_config.json + adapter_model.safetensors (peft), mtp_head.safetensors
    (mask embeddings, sampler) and mtpkit_config.json (method, k, base model, LoRA settings).
    `state_dict`: the full GatedMTP state dict when the module's own tensors are sharded (ZeRO-3)."""
    import dataclasses
    import json
    from pathlib import Path

    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    state = state_dict if state_dict is not None else model.state_dict()
    model.peft.save_pretrained(str(out), state_dict={k.removeprefix("peft."): v for k, v in state.items()
                                                     if k.startswith("peft.")})
    head = {k: v.detach().contiguous() for k, v in state.items() if k == "mask_embeds" or k.startswith("sampler.")}
    save_file(head, str(out / HEAD_WEIGHTS))
    config = {"method": "gated_lora", "base_model": base_model, "k": model.config.k,
              "gated_lora": dataclasses.asdict(model.config), **(extra or {})}
    (out / HEAD_CONFIG).write_text(json.dumps(config, indent=1))


def read_head_config(head_dir) -> dict:
    import json
    from pathlib import Path

    path = Path(head_dir) / HEAD_CONFIG
    if not path.is_file():
        raise FileNotFoundError(f"{head_dir}: no {HEAD_CONFIG}; expected a folder written by train/export.py "
                                "or a checkpoint's head/ folder")
    config = json.loads(path.read_text())
    if config.get("method") != "gated_lora":
        raise ValueError(f"{path}: method is {config.get('method')!r}, not 'gated_lora'")
    return config


def load_head(head_dir, base_model) -> GatedMTP:
    """The GatedMTP of a head folder on `base_model` (modified in place: peft injects its layers)."""
    from pathlib import Path

    from safetensors.torch import load_file

    config = read_head_config(head_dir)
    model = GatedMTP(base_model, GatedLoRAConfig(**config["gated_lora"]), adapter=str(head_dir))
    head = load_file(str(Path(head_dir) / HEAD_WEIGHTS))
    with torch.no_grad():
        model.mask_embeds.copy_(head.pop("mask_embeds"))
        if model.sampler is not None:
            model.sampler.load_state_dict({n.removeprefix("sampler."): t for n, t in head.items()})
    return model
