"""MTPC heads (arXiv:2511.11346, Sec. 3.3): circuit parameters from the backbone's hidden state.

`MTPCHead(cfg, lm_head_weight)` maps e_t [.., d] to `CircuitParams` of the window
x_{t+1..t+n}:
- input units: one unembedding per window position and rank, W [n, r, V, d], phi_{t,i,j} =
  softmax(W_ij e_t), all ranks of position i initialised from the same [V, d] matrix: the
  backbone's next-byte LM head, or, on a backbone with several next-byte heads (EvaByte: 8), its
  head i (`initial_unembeddings`, Sec. 4.1). Identical ranks make every mixture equal to FF at
  the start (CP with r = 1 *is* FF), so over the positions that have a head of their own an
  initialised circuit is the backbone's own MTP model;
- sum units: one projection per sum layer, omega = softmax(R e_t + b), R drawn small and random
  so that the ranks receive different gradients and drift apart;
- HMM transitions are identity at the start: T = I + g (softmax(R e + b) - I) with a learnable
  gate g per transition, 0 at init (clamped to [0, 1] in the forward pass, straight-through in
  the backward pass), so an initialised HMM computes exactly the CP of its input units and
  root weights (App. E), and the gradient reaches g, R and b from the first step.

`window_loss` is the training objective of Sec. 4.1 (Eq. 4).
"""

from __future__ import annotations

import dataclasses
import math

import torch
from torch import nn

from mtpkit.models.arch import adapter_for
from mtpkit.models.mtpc.circuits import ARCHS, CircuitParams, num_inner, prefix_log_probs


@dataclasses.dataclass
class MTPCConfig:
    arch: str = "btree"
    """circuit structure: ff | cp | hmm | btree (native code), or cirkit (any cirkit circuit, --circuit)"""
    n: int = 16
    """window: bytes drafted per cycle"""
    r: int = 32
    """rank: input units per position and units per sum layer (FF uses 1)"""
    init_std: float = 0.02
    """std of the sum-weight projections at init"""
    lora_layers: int = 0
    """LoRA on the last L layers of the draft copy of the backbone (0 = the verifier's state)"""
    lora_rank: int = 16
    """LoRA rank of the draft layers"""
    lora_alpha: float = 16.0
    """LoRA alpha of the draft layers"""
    init_from_backbone_heads: bool = True
    """on a backbone with H > 1 next-byte heads (EvaByte: 8, head h predicting x_{t+1+h}): window
    position i starts from head min(i, H - 1), so positions < H make the initial circuit the
    backbone's own MTP model (Sec. 4.1: EvaByte-MTP-CP starts equivalent to EvaByte-MTP); later
    positions start from the last head (an approximation: the paper does not say). False, or a
    one-head backbone (Llama): every position starts from the next-byte head"""
    circuit: str = "random-binary-tree"
    """arch=cirkit only: random-binary-tree | linear-tree | package.module:function(n, r, V) returning a
    smooth, decomposable cirkit symbolic circuit (models/mtpc/cirkit_head.py)"""

    def __post_init__(self):
        if self.arch not in ARCHS + ("cirkit",):
            raise ValueError(f"arch must be one of {ARCHS + ('cirkit',)}, got {self.arch!r}")
        if self.n < 2:
            raise ValueError(f"n must be >= 2, got {self.n}")
        for name in ("r", "lora_rank"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.lora_layers < 0:
            raise ValueError(f"lora_layers must be >= 0, got {self.lora_layers}")
        if not (math.isfinite(self.init_std) and self.init_std >= 0 and math.isfinite(self.lora_alpha)):
            raise ValueError(f"init_std must be finite and >= 0 and lora_alpha finite, got {self.init_std}, "
                             f"{self.lora_alpha}")
        if self.arch != "cirkit":
            num_inner(self.arch, self.n)  # btree: a power of two

    @property
    def units(self) -> int:
        return 1 if self.arch == "ff" else self.r


class _ClampST(torch.autograd.Function):
    """clamp(x, 0, 1) forward, identity backward (the gate can leave 0 in either direction)."""

    @staticmethod
    def forward(ctx, x):
        return x.clamp(0.0, 1.0)

    @staticmethod
    def backward(ctx, grad):
        return grad


def initial_unembeddings(head_weights: torch.Tensor, n: int, from_heads: bool = True) -> torch.Tensor:
    """The [n, V, d] matrices window positions 0..n-1 start from, given the backbone's
    next-byte heads [H, V, d] (head h predicts x_{t+1+h}; an ordinary LM head is H = 1): head
    min(i, H - 1) for position i, or head 0 everywhere when not `from_heads` (Sec. 4.1)."""
    H = head_weights.shape[0]
    if H == 1 or not from_heads:
        return head_weights[0].detach().expand(n, -1, -1)  # a view: no copy of a large LM head
    return head_weights.detach()[[min(i, H - 1) for i in range(n)]]


class MTPCHead(nn.Module):
    def __init__(self, cfg: MTPCConfig, lm_head_weight: torch.Tensor, seed: int = 0):
        """`lm_head_weight`: [V, d] (every position starts from it) or [n, V, d] (position i
        from row i, `initial_unembeddings`)."""
        super().__init__()
        self.cfg = cfg
        n, r, L = cfg.n, cfg.units, num_inner(cfg.arch, cfg.n)
        start = lm_head_weight.detach()
        start = start.expand(n, -1, -1) if start.dim() == 2 else start
        if start.shape[0] != n:
            raise ValueError(f"MTPCHead: {start.shape[0]} initial unembeddings for a window of {n}")
        V, d = start.shape[1:]
        self.vocab_size, self.hidden_size = V, d
        g = torch.Generator().manual_seed(seed)
        unembed = torch.empty(n, r, V, d, dtype=torch.float32, device=start.device)
        self.unembed = nn.Parameter(unembed.copy_(start[:, None]))  # [n, r, V, d], fp32
        self.root = self.root_bias = self.inner = self.inner_bias = self.gate = None
        if cfg.arch != "ff":
            self.root = nn.Parameter(torch.randn(r, d, generator=g) * cfg.init_std)
            self.root_bias = nn.Parameter(torch.zeros(r))
        if L:
            self.inner = nn.Parameter(torch.randn(L, r * r, d, generator=g) * cfg.init_std)
            self.inner_bias = nn.Parameter(torch.zeros(L, r * r))
        if cfg.arch == "hmm":
            self.gate = nn.Parameter(torch.zeros(L))

    def forward(self, hidden: torch.Tensor) -> CircuitParams:
        """hidden [B, d] -> the circuit of each row."""
        h = hidden.to(self.unembed.dtype)
        log_phi = torch.einsum("bd,nrvd->bnrv", h, self.unembed).log_softmax(-1)  # [B, n, r, V]
        return CircuitParams(self.cfg.arch, log_phi, *self._sums(h))

    def _sums(self, h: torch.Tensor, inner_logits: torch.Tensor | None = None
              ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The sum-unit weights of rows h [B, d]: root [B, r] and inner [B, L, r, r] (None for FF);
        `inner_logits` [B, L, r * r]: the inner projections already computed (without their bias),
        e.g. from a lower-precision copy of the weights at decoding."""
        if self.root is None:
            return None, None
        root = (h @ self.root.T + self.root_bias).softmax(-1)  # [B, r]
        inner = None
        if self.inner is not None:
            r = self.cfg.units
            logits = (torch.einsum("bd,lkd->blk", h, self.inner) if inner_logits is None else inner_logits) + self.inner_bias
            inner = logits.view(len(h), -1, r, r).softmax(-1)  # [B, L, r, r]
            if self.gate is not None:
                g = _ClampST.apply(self.gate)[None, :, None, None]
                eye = torch.eye(r, dtype=inner.dtype, device=inner.device)
                inner = eye + g * (inner - eye)
        return root, inner


def window_targets(labels: torch.Tensor, n: int, ignore: int = -100) -> tuple[torch.Tensor, torch.Tensor]:
    """Overlapping windows: for every position t the next n labels [B, T, n] and their validity.

    `labels` are next-token aligned (labels[t] is the byte after input t); positions past the
    end or carrying `ignore` (prompt bytes) are invalid, and are summed out of the circuit."""
    B, T = labels.shape
    padded = torch.cat([labels, labels.new_full((B, n - 1), ignore)], 1)
    windows = padded.unfold(1, n, 1)  # [B, T, n]
    return windows.clamp_min(0), windows != ignore


def window_loss(params: CircuitParams, targets: torch.Tensor, valid: torch.Tensor, example: torch.Tensor,
                num_examples: int, gamma: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Eq. (4) with exponential discount: sum_j gamma^(j-1) L_j / sum_j gamma^(j-1), where L_j
    is the negative log of q(x_{t+j} | x_{t+1..t+j-1}, context) summed over the windows of an
    example, divided by that example's number of valid bytes at offset j, and averaged over
    examples. Invalid bytes are marginalised, so their conditional is exactly 1.

    params: circuits of W windows; targets/valid [W, n]; example [W]: the example of each window.
    Returns (loss, per-offset mean NLL [n] in nats per valid byte, for logging)."""
    prefix = prefix_log_probs(params, targets, valid)  # [W, n]
    cond = prefix - torch.cat([prefix.new_zeros(len(prefix), 1), prefix[:, :-1]], 1)  # log q(x_j | x_<j)
    n = targets.shape[1]
    nll = prefix.new_zeros(num_examples, n).index_add(0, example, -cond * valid)
    counts = prefix.new_zeros(num_examples, n).index_add(0, example, valid.to(prefix.dtype))
    per_example = nll / counts.clamp_min(1)  # [E, n]
    has = (counts > 0).to(prefix.dtype)
    per_offset = (per_example * has).sum(0) / has.sum(0).clamp_min(1)  # [n]
    weights = gamma ** torch.arange(n, dtype=prefix.dtype, device=prefix.device)
    return (weights * per_offset).sum() / weights.sum(), per_offset.detach()


class DraftLayers(nn.Module):
    """The draft's own copy of the backbone's last L decoder layers and final norm, with LoRA
    (Sec. 3.3, e_t = LLM_LoRA(L)); the verifier keeps the untouched originals and the first
    N - L layers are shared. Layer indices are renumbered 0..L-1 for the draft's own KV cache.
    The layers run through the architecture's adapter (`mtpkit.models.arch`: its rotary
    interface and layer signature), so with zero LoRA they compute the backbone's own states."""

    def __init__(self, backbone, cfg: MTPCConfig, adapter=None):
        super().__init__()
        import copy

        from peft import LoraConfig, inject_adapter_in_model

        adapter = adapter_for(backbone) if adapter is None else adapter
        total = len(adapter.layers)
        if not 0 < cfg.lora_layers <= total:
            raise ValueError(f"lora_layers must be in 1..{total}, got {cfg.lora_layers}")
        self.start = total - cfg.lora_layers  # hidden_states[start] is the shared state
        self.layers = nn.ModuleList(copy.deepcopy(adapter.layers[self.start:]))
        for i, layer in enumerate(self.layers):
            layer.self_attn.layer_idx = i
        self.norm = copy.deepcopy(adapter.norm)
        self.__dict__["adapter"] = adapter  # holds the backbone (its rotary tables): not a submodule
        for p in self.parameters():
            p.requires_grad_(False)
        inject_adapter_in_model(LoraConfig(r=cfg.lora_rank, lora_alpha=cfg.lora_alpha, lora_dropout=0.0,
                                           target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                           "up_proj", "down_proj"]), self)

    def forward(self, shared: torch.Tensor, position_ids: torch.Tensor, past_key_values=None) -> torch.Tensor:
        """shared [B, T, d] (after layer N - L) -> e [B, T, d] (normalised, as fed to the LM head).
        Without a cache the attention is causal over T; with one, T new positions attend to it."""
        mask, T = None, shared.shape[1]
        past = 0 if past_key_values is None else past_key_values.get_seq_length()
        if past and T > 1:  # new positions see the whole cache and each other causally
            allowed = torch.ones(T, past + T, dtype=torch.bool, device=shared.device).tril(past)
            mask = torch.zeros(T, past + T, dtype=shared.dtype, device=shared.device)
            mask = mask.masked_fill(~allowed, torch.finfo(shared.dtype).min)[None, None]
        return self.norm(self.adapter.run_layers(self.layers, shared, position_ids, mask, past_key_values))


def segment_spans(segments: torch.Tensor) -> list[tuple[int, int]]:
    """(start, end) of each example in one packed row `segments` [T] (example index, -1 = padding)."""
    seg = segments.tolist()
    spans, start = [], 0
    while start < len(seg) and seg[start] >= 0:
        end = start + 1
        while end < len(seg) and seg[end] == seg[start]:
            end += 1
        spans.append((start, end))
        start = end
    return spans


class MTPCModel(nn.Module):
    """Head (+ optional draft layers) over a frozen backbone. Only the head and LoRA train."""

    def __init__(self, backbone, cfg: MTPCConfig, seed: int = 0):
        super().__init__()
        self.cfg = cfg
        self.__dict__["backbone"] = backbone  # frozen and outside state_dict / DDP
        for p in backbone.parameters():
            p.requires_grad_(False)
        self.__dict__["adapter"] = adapter = adapter_for(backbone)  # the backbone's body and heads
        start = initial_unembeddings(adapter.head_weights(), cfg.n, cfg.init_from_backbone_heads)  # [n, V, d]
        if cfg.arch == "cirkit":
            from mtpkit.models.mtpc.cirkit_head import CirkitHead, build_circuit

            circuit = build_circuit(cfg.circuit, cfg.n, cfg.r, adapter.vocab_size)
            self.head = CirkitHead(circuit, cfg.n, start, init_std=cfg.init_std, seed=seed)
        else:
            self.head = MTPCHead(cfg, start, seed=seed)
        self.draft = DraftLayers(backbone, cfg, adapter) if cfg.lora_layers else None

    def features(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                 segments: torch.Tensor | None = None) -> torch.Tensor:
        """e_t for every position [B, T, d]: the backbone's final state, or the draft layers' on
        top of the shared state after layer N - L. With `segments` [B, T] (packed sequences,
        `mtpkit.data.packed`: example index, -1 = padding) each example is encoded on its own from
        position 0, so attention never crosses examples, on any attention (EVA has no document
        mask); padding rows are zero."""
        if segments is not None:
            rows = []
            for b in range(input_ids.shape[0]):
                parts = [self.features(input_ids[b:b + 1, s:e])[0] for s, e in segment_spans(segments[b].cpu())]
                used = sum(len(p) for p in parts)
                if used < input_ids.shape[1]:
                    parts.append(parts[0].new_zeros(input_ids.shape[1] - used, parts[0].shape[-1]))
                rows.append(torch.cat(parts))
            return torch.stack(rows)  # [B, T, d]
        with torch.no_grad():
            out = self.adapter.body(input_ids=input_ids, attention_mask=attention_mask,
                                 output_hidden_states=self.draft is not None)
        if self.draft is None:
            return out.last_hidden_state
        shared = out.hidden_states[self.draft.start]
        positions = torch.arange(input_ids.shape[1], device=input_ids.device).expand(input_ids.shape[0], -1)
        return self.draft(shared, positions)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None, rows: torch.Tensor,
                cols: torch.Tensor, segments: torch.Tensor | None = None) -> CircuitParams:
        """The circuits of the windows after positions (rows, cols) of the batch."""
        return self.head(self.features(input_ids, attention_mask, segments)[rows, cols])

    def trainable_state_dict(self) -> dict[str, torch.Tensor]:
        return {k: v for k, v in self.state_dict().items()
                if k.startswith("head.") or "lora_" in k}
