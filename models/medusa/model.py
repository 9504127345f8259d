"""Medusa-1 and Hydra draft heads over a frozen backbone's last hidden state.

- Medusa ("Medusa: Simple LLM Inference Acceleration Framework with Multiple Decoding Heads", Cai
  et al., arXiv:2401.10774, Sec. 2.1.1): head i (i = 1..K) maps the backbone's last hidden state
  h_t to logits over x_{t+i+1}, independently of the other heads:
      p_i(x_{t+i+1}) = softmax(W_i ResBlock_i(h_t)),   ResBlock(x) = x + SiLU(A x + b)
  with A, b zero at init (so every head starts as the backbone's own next-token head), one or
  more ResBlocks per head (`layers`).
- Hydra ("Hydra: Sequentially-Dependent Draft Heads for Medusa Decoding", Ankner et al.,
  arXiv:2402.05109, Sec. 3): head i also reads the input embeddings of the i tokens before the one
  it predicts, x_{t+1} (the target's own next token: the step's bonus) .. x_{t+i} (drafted by the
  heads before it), so the draft is a chain of conditionals:
      p_i(x_{t+i+1} | x_{t+1..t+i}) = softmax(W_i ResBlocks(R_i u + SiLU(A_i u + b_i))),
      u = [h_t; E(x_{t+1}); ...; E(x_{t+i})]                                  (width (i + 1) d)
  Its first block maps the concatenation back to d with a linear residual R_i (Hydra's
  `ResBlock(hidden, num_condition)`); mtpkit starts R_i at [I 0 ... 0], so an untrained Hydra head
  is the backbone's next-token head too (Hydra initialises R_i at random).
- Hydra++'s prefix attention (`prefix_layer`): one more decoder layer of the backbone's
  architecture over its last hidden states, causal over the sequence; every head reads its output
  e_t instead of h_t. mtpkit starts it as a copy of the backbone's last decoder layer with its two
  output projections (o_proj, down_proj) zeroed, so it starts as the identity, e_t = h_t (Hydra
  starts a fresh layer at random).

W_i (`lm_head`): `shared` uses the backbone's own LM head, frozen, for every head (only the
blocks train: d^2 weights a block, which trains in minutes on a CPU); `copy` gives each head its
own vocabulary projection initialised from the LM head, as both papers do (V x d weights a head).

Training (`head_losses`): at every anchor position t of a sequence the heads' targets are the
data tokens x_{t+i+1} (cross-entropy, Medusa-1's loss) or, with `distill`, the target's own
distribution over x_{t+i+1} given the true prefix, softmax(lm_head(h_{t+i})) (Hydra++'s teacher
distillation: read off the cached hidden states, no extra backbone forward). Head i's
loss is weighted by `decay`^(i-1) (Medusa's lambda_k = 0.8^k).
"""

from __future__ import annotations

import copy
import dataclasses

import torch
import torch.nn.functional as F
from torch import nn

from mtpkit.models.arch import adapter_for

ARCHS = ("medusa", "hydra")
LM_HEADS = ("shared", "copy")
IGNORE = -100


@dataclasses.dataclass
class MedusaConfig:
    arch: str = "medusa"
    """medusa (each head reads h_t alone) | hydra (head i also reads the embeddings of the i tokens
    before the one it predicts: sequentially dependent drafts)"""
    heads: int = 4
    """K: draft heads, head i predicting the token i + 1 after the last accepted one (the deepest
    draft a tree may have)"""
    layers: int = 1
    """residual blocks per head (Medusa-1: 1; Hydra++: 4)"""
    lm_head: str = "shared"
    """shared: every head projects through the backbone's own LM head, frozen (only the blocks
    train) | copy: each head its own vocabulary projection, initialised from the LM head (the
    papers'; K x V x d more weights to train and store)"""
    prefix_layer: bool = False
    """Hydra++'s prefix attention: the heads read the output of one more decoder layer over the
    backbone's last hidden states (trained with them; a decoding step then runs that layer over
    the accepted tokens) instead of the last hidden state itself"""

    def __post_init__(self):
        if self.arch not in ARCHS:
            raise ValueError(f"arch must be one of {ARCHS}, got {self.arch!r}")
        if self.lm_head not in LM_HEADS:
            raise ValueError(f"lm_head must be one of {LM_HEADS}, got {self.lm_head!r}")
        for name in ("heads", "layers"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")


class ResBlock(nn.Module):
    """y = R x + SiLU(A x + b); R = identity for a block of width d (Medusa's ResBlock), a linear
    map [I 0 ... 0] at init for a block reading `inputs` > 1 concatenated vectors (Hydra's first
    block). A and b start at zero: the block starts as y = x (or y = the first input)."""

    def __init__(self, d: int, inputs: int = 1):
        super().__init__()
        self.linear = nn.Linear(d * inputs, d)
        nn.init.zeros_(self.linear.weight)
        nn.init.zeros_(self.linear.bias)
        self.res = None
        if inputs > 1:
            self.res = nn.Linear(d * inputs, d, bias=False)
            with torch.no_grad():
                self.res.weight.zero_()
                self.res.weight[:, :d].copy_(torch.eye(d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        r = x if self.res is None else self.res(x)
        return r + F.silu(self.linear(x))


class PrefixLayer(nn.Module):
    """Hydra++'s prefix-attention layer: a copy of the backbone's last decoder layer, run through
    the architecture's adapter (its rotary tables, its layer signature) on the backbone's last
    hidden states, with its own KV cache when decoding. o_proj and down_proj start at zero: the
    layer starts as the identity."""

    def __init__(self, adapter):
        super().__init__()
        layer = copy.deepcopy(adapter.layers[-1])
        layer.self_attn.layer_idx = 0  # its own one-layer cache
        with torch.no_grad():
            for proj in (layer.self_attn.o_proj, layer.mlp.down_proj):
                proj.weight.zero_()
                if proj.bias is not None:
                    proj.bias.zero_()
        for p in layer.parameters():
            p.requires_grad_(True)
        self.layers = nn.ModuleList([layer])
        self.__dict__["adapter"] = adapter  # holds the backbone (its rotary tables): not a submodule

    def forward(self, hidden: torch.Tensor, position_ids: torch.Tensor, past_key_values=None) -> torch.Tensor:
        """hidden [B, T, d] at position_ids [B, T] -> e [B, T, d]. Without a cache the attention is
        causal over T; with one, T new positions attend to it and causally to each other."""
        hidden = hidden.to(self.layers[0].self_attn.o_proj.weight.dtype)
        mask, T = None, hidden.shape[1]
        past = 0 if past_key_values is None else past_key_values.get_seq_length()
        if past and T > 1:
            allowed = torch.ones(T, past + T, dtype=torch.bool, device=hidden.device).tril(past)
            mask = torch.zeros(T, past + T, dtype=hidden.dtype, device=hidden.device)
            mask = mask.masked_fill(~allowed, torch.finfo(hidden.dtype).min)[None, None]
        return self.adapter.run_layers(self.layers, hidden, position_ids, mask, past_key_values)


class MedusaHeads(nn.Module):
    """K draft heads over a frozen `backbone` (held outside the state dict: only the heads train
    and save). `hidden(i, h, prev)` -> z [R, d], `logits(i, z)` -> [R, V] for head i = 0..K-1
    (predicting x_{t+i+2}); Hydra's `prev` [R, i + 1] are the tokens x_{t+1..t+i+1}."""

    def __init__(self, backbone, cfg: MedusaConfig):
        super().__init__()
        self.cfg = cfg
        self.__dict__["backbone"] = backbone  # frozen, outside state_dict / DDP
        self.__dict__["adapter"] = adapter = adapter_for(backbone)
        d = backbone.config.hidden_size
        weight = adapter.lm_head.weight  # [V, d]
        hydra = cfg.arch == "hydra"
        self.blocks = nn.ModuleList(
            nn.Sequential(ResBlock(d, i + 2 if hydra else 1), *[ResBlock(d) for _ in range(cfg.layers - 1)])
            for i in range(cfg.heads))
        self.prefix = PrefixLayer(adapter) if cfg.prefix_layer else None
        self.proj = None
        if cfg.lm_head == "copy":
            self.proj = nn.ModuleList(nn.Linear(d, weight.shape[0], bias=False) for _ in range(cfg.heads))
            with torch.no_grad():
                for p in self.proj:
                    p.weight.copy_(weight.detach().float())
        self.to(device=weight.device)
        self.other_backbone = False  # set by load_head: the bench marks a head on another backbone

    @property
    def hydra(self) -> bool:
        return self.cfg.arch == "hydra"

    @property
    def embed(self) -> nn.Module:
        return self.backbone.get_input_embeddings()

    def hidden(self, i: int, h: torch.Tensor, prev: torch.Tensor | None = None) -> torch.Tensor:
        """Head i's state z [R, d] from h [R, d] (and, for Hydra, the tokens prev [R, i + 1])."""
        block = self.blocks[i]
        dtype = block[0].linear.weight.dtype
        x = h.to(dtype)
        if self.hydra:
            x = torch.cat([x, self.embed(prev).to(dtype).flatten(-2)], -1)  # [R, (i + 2) d]
        return block(x)

    def logits(self, i: int, z: torch.Tensor, lm_head=None) -> torch.Tensor:
        """Head i's logits [R, V] from z [R, d]: its own projection (`copy`), else `lm_head` (the
        decoder's, possibly packed) or the backbone's."""
        if self.proj is not None:
            return self.proj[i](z)
        head = lm_head if lm_head is not None else self.adapter.lm_head
        return head(z.to(head.weight.dtype))

    def prefix_states(self, hidden: torch.Tensor) -> torch.Tensor:
        """The heads' inputs e [B, T, d] of whole sequences of last hidden states [B, T, d] (the
        prefix layer's output; the states themselves without one). Right-padding is harmless:
        attention is causal."""
        if self.prefix is None:
            return hidden
        positions = torch.arange(hidden.shape[1], device=hidden.device).expand(hidden.shape[0], -1)
        return self.prefix(hidden, positions)

    def forward(self, hidden: torch.Tensor, future: torch.Tensor, valid: torch.Tensor,
                teacher_hidden: torch.Tensor | None = None, decay: float = 0.8,
                sequences: torch.Tensor | None = None, where: torch.Tensor | None = None) -> dict:
        """The training losses of a batch of R anchor rows (`anchor_rows`, `collate_rows`): hidden
        [R, d] = h_t, future [R, K + 1] = x_{t+1..t+K+1}, valid [R, K] (head i's target is an
        assistant token), teacher_hidden [R, K, d] = h_{t+1..t+K} (distillation; None:
        cross-entropy on the data tokens); with the prefix layer, sequences [B, T, d] (the whole
        sequences' states, right-padded) and where [R, 2] (each row's sequence and position), which
        the layer reads instead of `hidden`. Returns loss, per-head loss and top-1 accuracy
        against the data token."""
        if self.prefix is not None:
            hidden = self.prefix_states(sequences)[where[:, 0], where[:, 1]]
        out, total, weights = {}, 0.0, 0.0
        for i in range(self.cfg.heads):
            rows = valid[:, i].nonzero(as_tuple=True)[0]
            z = self.hidden(i, hidden[rows], future[rows, : i + 1] if self.hydra else None)
            log_q = self.logits(i, z).float().log_softmax(-1)  # [r, V]
            if len(rows) == 0:
                # no target for head i here: its weights still enter the loss (times zero), so
                # under DDP every process's backward reduces the same parameters (a head left
                # out on one process alone mismatches the processes' gradient all-reduces)
                total = total + 0.0 * log_q.sum()
                out[f"loss_h{i + 1}"] = out[f"acc_h{i + 1}"] = torch.tensor(float("nan"))
                continue
            if teacher_hidden is None:
                loss = F.nll_loss(log_q, future[rows, i + 1])
            else:
                with torch.no_grad():
                    log_p = self.adapter.lm_head(teacher_hidden[rows, i]).float().log_softmax(-1)
                loss = F.kl_div(log_q, log_p, log_target=True, reduction="batchmean")
            w = decay ** i
            total, weights = total + w * loss, weights + w
            out[f"loss_h{i + 1}"] = loss.detach()
            out[f"acc_h{i + 1}"] = (log_q.argmax(-1) == future[rows, i + 1]).float().mean().detach()
        out["loss"] = total / weights if weights else total
        return out

    def trainable_state_dict(self) -> dict[str, torch.Tensor]:
        return dict(self.state_dict())


def anchor_rows(hidden: torch.Tensor, input_ids: torch.Tensor, labels: torch.Tensor, K: int,
                positions: int = 0, generator: torch.Generator | None = None, teacher: bool = False) -> dict:
    """One sequence's training rows for K heads: every position t whose head-1 target x_{t+2} is an
    assistant token (or `positions` of them drawn at random; 0 = all). hidden [T, d] (the frozen
    backbone's last hidden states), input_ids and labels [T] (labels[t] = input_ids[t] on
    assistant tokens, IGNORE elsewhere). Returns hidden [R, d], future [R, K + 1], valid [R, K]
    and, with `teacher`, teacher_hidden [R, K, d] (see `MedusaHeads.forward`)."""
    T = len(input_ids)
    start = torch.arange(T)
    offsets = torch.arange(1, K + 2)  # x_{t+1} .. x_{t+K+1}
    where = start[:, None] + offsets[None]  # [T, K + 1]
    inside = where < T
    clamped = where.clamp(max=T - 1)
    future = torch.where(inside, input_ids[clamped], 0)
    valid = inside[:, 1:] & (labels[clamped[:, 1:]] != IGNORE)  # [T, K]: x_{t+i+1} of head i is learned
    rows = valid[:, 0].nonzero(as_tuple=True)[0]
    if positions and len(rows) > positions:
        rows = rows[torch.randperm(len(rows), generator=generator)[:positions]].sort().values
    out = {"hidden": hidden[rows], "future": future[rows], "valid": valid[rows], "positions": rows,
           "sequence": hidden}
    if teacher:
        out["teacher_hidden"] = hidden[clamped[rows, :K]]  # h_{t+1} .. h_{t+K}
    return out


def collate_rows(parts: list[dict], sequences: bool = False) -> dict:
    """`anchor_rows` of several sequences as one batch: rows concatenated; with `sequences` (the
    prefix layer) also the whole sequences right-padded, [B, T, d], and each row's (sequence,
    position), `where` [R, 2]."""
    out = {key: torch.cat([p[key] for p in parts]) for key in parts[0] if key not in ("positions", "sequence")}
    if sequences:
        T = max(len(p["sequence"]) for p in parts)
        out["sequences"] = torch.stack([F.pad(p["sequence"], (0, 0, 0, T - len(p["sequence"]))) for p in parts])
        out["where"] = torch.cat([torch.stack([torch.full_like(p["positions"], b), p["positions"]], -1)
                                  for b, p in enumerate(parts)])
    return out
