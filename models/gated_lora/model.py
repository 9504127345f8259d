"""Gated-LoRA mask-token MTP, the training model ("Your LLM Knows the Future: Uncovering Its
Multi-Token Prediction Potential", Samragh et al., arXiv:2507.11851).

- k mask tokens with their own input embeddings (random vectors with the embedding table's
  statistics, Sec. 2), fed through the backbone where token embeddings would go. Frozen by
  default, as in the paper, which fine-tunes only the LoRA and the sampler (Sec. 3);
  `train_mask_embeds` trains them too.
- Gated LoRA on every targeted linear layer of the decoder (Sec. 2.2):

      y_t = W x_t + I(t) * (alpha / r) * B A x_t,      I(t) = 1 only at mask positions

  built on peft (so its adapter save/load holds) with two hooks per layer: a pre-hook on the
  LoRA dropout keeps only the gated rows, a hook on `lora_B` scatters the delta back into
  zeros. Ungated rows get `W x + 0` (bit-identical to the base model) and the delta is only
  computed where it is used. The adapter is never merged. `gated=False` is plain LoRA (I(t) = 1
  everywhere), the baseline of the paper's Figure 6: next-token outputs then change.
- The sampler head (Sec. 2.3): p = W_unembed * MLP([E(y_prev); z]), the MLP two blocks of
  Linear -> SiLU -> LayerNorm from 2d to d.
- The training forward returns the Sec. 2.5 losses: base and sampler cross-entropy over NTP
  and mask positions plus the latent-consistency loss of Eq. 1 (each weighted and logged
  apart). It takes either the one-forward Figure-4 batch (`collate_mask_inputs`) or the
  two-forward batch of `collate_cached` (the NTP slots once without gradient, then the masks
  over their cached keys/values): the same losses, backward over the mask slots only.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn


IGNORE = -100  # label of positions without a loss: torch's ignore_index, as in mtpkit.data.chat
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
    lcm: str = "l2"
    """latent-consistency distance: l2 = Eq. 1, the squared L2 distance summed over the d hidden
    dimensions; l2_per_dim = the same divided by d (lcm_weight w with it equals w / d with l2; the
    `lcm-per-dim` variant of eval/ablate.py)"""
    gated: bool = True
    """gate the LoRA on at mask positions only (the paper); False = plain LoRA on every position
    (the ablation baseline: next-token outputs no longer equal the base model's)"""
    train_mask_embeds: bool = False
    """train the mask embeddings too (the paper fine-tunes only the LoRA and the sampler)"""


LCM_DISTANCES = ("l2", "l2_per_dim")


class Gate:
    """Which rows of the current forward get the LoRA delta. Outside `with gate(mask):` none do;
    inside, the rows where `mask` is True, or every row when `everywhere` (plain LoRA)."""

    def __init__(self, everywhere: bool = False):
        self.everywhere = everywhere
        self.rows: torch.Tensor | None = None  # flat indices of gated rows
        self.shape: torch.Size | None = None   # [B, T] of the forward
        self.span: tuple[int, int] | None = None  # (start, end) if the rows of a batch-1 forward are one run
        self.all = False  # every row is gated: select and scatter are reshapes

    @contextlib.contextmanager
    def __call__(self, gate: torch.Tensor):
        """gate: [B, T] bool, True where the adapter is on (mask tokens)."""
        previous = self.rows, self.shape, self.span, self.all
        if self.everywhere:
            gate = torch.ones_like(gate, dtype=torch.bool)
        self.rows, self.shape, self.span = gate.reshape(-1).nonzero().squeeze(1), gate.shape, None
        self.all = self.rows.numel() == gate.numel()  # every row (plain LoRA, a batch of masks only)
        if gate.shape[0] == 1 and self.rows.numel():  # decoding: the gated masks are the suffix
            start, end = int(self.rows[0]), int(self.rows[-1]) + 1
            self.span = (start, end) if end - start == self.rows.numel() else None
        try:
            yield
        finally:
            self.rows, self.shape, self.span, self.all = previous

    @contextlib.contextmanager
    def suffix(self, start: int, length: int, device=None):
        """`with gate(mask)` for a batch-1 forward of `length` rows whose gated rows are the run
        [start, length) (a decoding step's extra nodes), set from the two ints alone: no mask is
        built or read (on a GPU, reading one back is a host sync); `device`: where the rows' index
        is made (a captured step copies nothing from the host)."""
        previous = self.rows, self.shape, self.span, self.all
        start = 0 if self.everywhere else start
        self.rows, self.shape = torch.arange(start, length, device=device), torch.Size((1, length))
        self.span = (start, length) if start < length else None
        self.all = start == 0
        try:
            yield
        finally:
            self.rows, self.shape, self.span, self.all = previous

    def select(self, x: torch.Tensor) -> torch.Tensor:  # [B, T, d] -> [n_gated, d]
        if self.rows is None:
            return x.new_zeros(0, x.shape[-1])
        if x.shape[:-1] != self.shape:
            raise RuntimeError(f"gated LoRA: input of shape {tuple(x.shape)} under a gate of shape "
                               f"{tuple(self.shape)}; run the forward inside `with gate(mask)` of its shape")
        if self.all:
            return x.reshape(-1, x.shape[-1])
        if self.rows.device != x.device:  # a gate mask built on the host (the decoder's): moved once per gate
            self.rows = self.rows.to(x.device)
        return x.reshape(-1, x.shape[-1]).index_select(0, self.rows)

    def scatter(self, delta: torch.Tensor, like: torch.Tensor) -> torch.Tensor:  # -> [B, T, out]
        if self.all:
            return delta.view(*like.shape[:-1], delta.shape[-1])
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
        if config.lcm not in LCM_DISTANCES:
            raise ValueError(f"gated LoRA lcm must be one of {LCM_DISTANCES}, got {config.lcm!r}")
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
        self.gate = Gate(everywhere=not config.gated)
        add_gate_hooks(self.peft, self.gate)
        inner = self.peft.get_base_model()
        # plain references (not submodules: the backbone is registered once, under `peft`)
        self.__dict__.update(body=inner.get_decoder(), embed=inner.get_input_embeddings())
        table = self.embed.weight.detach().float()
        d = table.shape[1]
        # random vectors with the embedding table's per-dimension statistics (Sec. 2: "generated
        # as random vectors and added to the embedding table")
        # drawn on the CPU, so the init is the same on any device
        init = table.mean(0) + table.std(0) * torch.randn(config.k, d).to(table.device)
        # float32 whatever the backbone's dtype (cast where used): frozen or trained, the head
        # file holds the same float32 init on any backbone dtype
        self.mask_embeds = nn.Parameter(init, requires_grad=config.train_mask_embeds)  # [k, d] float32
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

    def next_token_logits(self, input_ids: torch.Tensor, attention_mask=None) -> torch.Tensor:
        """The model's own next-token logits [B, T, V] on plain tokens: the base model's, bit for
        bit, when gated; with the adapter on every position for plain LoRA."""
        with self.gate(torch.zeros_like(input_ids, dtype=torch.bool)):
            hidden = self.body(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).last_hidden_state
        return self.lm_head(hidden)

    # Checkpoints hold what training owns (LoRA, mask embeddings, sampler): the frozen backbone
    # is re-read from --backbone, so a checkpoint of a 135M model is ~MBs, not 540 MB.
    def state_dict(self, *args, **kwargs):
        state = super().state_dict(*args, **kwargs)
        prefix = kwargs.get("prefix", "")
        return type(state)((k, v) for k, v in state.items() if k not in self._backbone_names(prefix))

    def _backbone_names(self, prefix: str = "") -> set[str]:
        """State names of the frozen backbone's parameters (the rest is the head's own)."""
        return {f"{prefix}peft.{n}" for n, p in self.peft.named_parameters(remove_duplicate=False)
                if not p.requires_grad}

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        missing, unexpected = super().load_state_dict(state_dict, strict=False, assign=assign)
        # frozen mask embeddings may be absent (a trainer's state/ holds trainable tensors only):
        # they are the seeded init, rebuilt the same by the constructor
        optional = self._backbone_names() | ({"mask_embeds"} if not self.mask_embeds.requires_grad else set())
        missing = [k for k in missing if k not in optional]
        if strict and (missing or unexpected):
            raise RuntimeError(f"GatedMTP.load_state_dict: missing trainable {missing[:5]}, unexpected {unexpected[:5]}")
        return torch.nn.modules.module._IncompatibleKeys(missing, unexpected)

    # ---- training forward (Sec. 2.5) ----
    def forward(self, mask_index, position_ids, attention_mask, labels, prev_ids, input_ids=None, ntp_slot=None,
                ntp_ids=None, ntp_labels=None, ntp_attention_mask=None, lcm_pos=None):
        """Losses of one batch built by `mtpkit.data.mtp.collate_mask_inputs` (one forward), or by
        `collate_cached` (`ntp_*` and `lcm_pos`: two forwards, gated LoRA only).

        Returns {"loss": weighted total, "base_ntp", "base_mtp", "sampler_ntp", "sampler_mtp",
        "lcm", "acc_m1".."acc_mk"} (the parts detached, for logging).
        """
        if ntp_ids is None:
            hidden = self.hidden_states(input_ids, mask_index, position_ids, attention_mask)  # [B, T, d]
            return self.losses(hidden, mask_index, labels, prev_ids, ntp_slot)
        if not self.config.gated:
            raise ValueError("the cached two-forward batch needs gated LoRA: with plain LoRA the NTP "
                             "positions carry the adapter and need their gradient (use collate_mask_inputs)")
        # 1. the NTP tokens through the frozen backbone (gate off: no adapter), keys/values kept
        with torch.no_grad(), self.gate(torch.zeros_like(ntp_ids, dtype=torch.bool)):
            out = self.body(input_ids=ntp_ids, attention_mask=ntp_attention_mask, use_cache=True)
        # 2. the mask slots over that cache, gated, with gradient
        with self.gate(mask_index > 0):
            masks = self.body(inputs_embeds=self.input_embeds(torch.zeros_like(mask_index), mask_index),
                              attention_mask=attention_mask, position_ids=position_ids,
                              past_key_values=out.past_key_values, use_cache=True).last_hidden_state
        # one [NTP..., masks...] layout for `losses`: NTP position p is column p
        n = ntp_ids.shape[1]
        hidden = torch.cat([out.last_hidden_state.to(masks.dtype), masks], dim=1)
        positions = torch.arange(n, device=ntp_ids.device).expand_as(ntp_ids)
        return self.losses(hidden, torch.cat([torch.zeros_like(ntp_ids), mask_index], 1),
                           torch.cat([ntp_labels, labels], 1), torch.cat([ntp_ids, prev_ids], 1),
                           torch.cat([positions, lcm_pos], 1))

    def losses(self, hidden, mask_index, labels, prev_ids, ntp_slot) -> dict[str, torch.Tensor]:
        """The Sec. 2.5 losses from last-layer hidden states [B, T, d] of a Figure-4 batch
        (`ntp_slot`: the column of each slot's consistency anchor)."""
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
            dist = (hidden[lcm_rows] - anchors).pow(2).sum(-1)                                     # [m]
            if c.lcm == "l2_per_dim":
                dist = dist / hidden.shape[-1]
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
