"""MTPC heads (arXiv:2511.11346, Sec. 3.3): circuit parameters from the backbone's hidden state.

`MTPCHead(cfg, lm_head_weight)` maps e_t [.., d] to `CircuitParams` of the window
x_{t+1..t+n}:
- input units: one unembedding per window position and rank, W [n, r, V, d], all initialised
  from the backbone's LM head, phi_{t,i,j} = softmax(W_ij e_t). Identical ranks make every
  mixture equal to FF at the start (CP with r = 1 *is* FF);
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

import torch
from torch import nn

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
    circuit: str = "random-binary-tree"
    """arch=cirkit only: random-binary-tree | linear-tree | package.module:function(n, r, V) returning a
    smooth, decomposable cirkit symbolic circuit (models/mtpc/cirkit_head.py)"""

    def __post_init__(self):
        if self.arch not in ARCHS + ("cirkit",):
            raise ValueError(f"arch must be one of {ARCHS + ('cirkit',)}, got {self.arch!r}")
        if self.n < 2:
            raise ValueError(f"n must be >= 2, got {self.n}")
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


class MTPCHead(nn.Module):
    def __init__(self, cfg: MTPCConfig, lm_head_weight: torch.Tensor, seed: int = 0):
        super().__init__()
        self.cfg = cfg
        V, d = lm_head_weight.shape
        n, r, L = cfg.n, cfg.units, num_inner(cfg.arch, cfg.n)
        self.vocab_size, self.hidden_size = V, d
        g = torch.Generator().manual_seed(seed)
        self.unembed = nn.Parameter(lm_head_weight.detach().float().clone()[None, None].repeat(n, r, 1, 1))
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

    def _sums(self, h: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The sum-unit weights of rows h [B, d]: root [B, r] and inner [B, L, r, r] (None for FF)."""
        if self.root is None:
            return None, None
        root = (h @ self.root.T + self.root_bias).softmax(-1)  # [B, r]
        inner = None
        if self.inner is not None:
            r = self.cfg.units
            logits = torch.einsum("bd,lkd->blk", h, self.inner) + self.inner_bias
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
    N - L layers are shared. Layer indices are renumbered 0..L-1 for the draft's own KV cache."""

    def __init__(self, backbone, cfg: MTPCConfig):
        super().__init__()
        import copy

        from peft import LoraConfig, inject_adapter_in_model

        body = backbone.model
        total = len(body.layers)
        if not 0 < cfg.lora_layers <= total:
            raise ValueError(f"lora_layers must be in 1..{total}, got {cfg.lora_layers}")
        self.start = total - cfg.lora_layers  # hidden_states[start] is the shared state
        self.layers = nn.ModuleList(copy.deepcopy(body.layers[self.start:]))
        for i, layer in enumerate(self.layers):
            layer.self_attn.layer_idx = i
        self.norm = copy.deepcopy(body.norm)
        self.__dict__["rotary"] = body.rotary_emb  # shared with the backbone, not a submodule
        for p in self.parameters():
            p.requires_grad_(False)
        inject_adapter_in_model(LoraConfig(r=cfg.lora_rank, lora_alpha=cfg.lora_alpha, lora_dropout=0.0,
                                           target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                           "up_proj", "down_proj"]), self)

    def forward(self, shared: torch.Tensor, position_ids: torch.Tensor, past_key_values=None) -> torch.Tensor:
        """shared [B, T, d] (after layer N - L) -> e [B, T, d] (normalised, as fed to the LM head).
        Without a cache the attention is causal over T; with one, T new positions attend to it."""
        position_embeddings = self.rotary(shared, position_ids)
        mask, T = None, shared.shape[1]
        past = 0 if past_key_values is None else past_key_values.get_seq_length()
        if past and T > 1:  # new positions see the whole cache and each other causally
            allowed = torch.ones(T, past + T, dtype=torch.bool, device=shared.device).tril(past)
            mask = torch.zeros(T, past + T, dtype=shared.dtype, device=shared.device)
            mask = mask.masked_fill(~allowed, torch.finfo(shared.dtype).min)[None, None]
        h = shared
        for layer in self.layers:
            h = layer(h, attention_mask=mask, position_ids=position_ids, past_key_values=past_key_values,
                      use_cache=past_key_values is not None, position_embeddings=position_embeddings)
            h = h[0] if isinstance(h, tuple) else h
        return self.norm(h)


class MTPCModel(nn.Module):
    """Head (+ optional draft layers) over a frozen backbone. Only the head and LoRA train."""

    def __init__(self, backbone, cfg: MTPCConfig, seed: int = 0):
        super().__init__()
        self.cfg = cfg
        self.__dict__["backbone"] = backbone  # frozen and outside state_dict / DDP
        for p in backbone.parameters():
            p.requires_grad_(False)
        lm_head = backbone.get_output_embeddings().weight
        if cfg.arch == "cirkit":
            from mtpkit.models.mtpc.cirkit_head import CirkitHead, build_circuit

            circuit = build_circuit(cfg.circuit, cfg.n, cfg.r, lm_head.shape[0])
            self.head = CirkitHead(circuit, cfg.n, lm_head, init_std=cfg.init_std, seed=seed)
        else:
            self.head = MTPCHead(cfg, lm_head, seed=seed)
        self.draft = DraftLayers(backbone, cfg) if cfg.lora_layers else None

    def features(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """e_t for every position [B, T, d]: the backbone's final state, or the draft layers' on
        top of the shared state after layer N - L."""
        with torch.no_grad():
            out = self.backbone.model(input_ids=input_ids, attention_mask=attention_mask,
                                      output_hidden_states=self.draft is not None)
        if self.draft is None:
            return out.last_hidden_state
        shared = out.hidden_states[self.draft.start]
        positions = torch.arange(input_ids.shape[1], device=input_ids.device).expand(input_ids.shape[0], -1)
        return self.draft(shared, positions)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None, rows: torch.Tensor,
                cols: torch.Tensor) -> CircuitParams:
        """The circuits of the windows after positions (rows, cols) of the batch."""
        return self.head(self.features(input_ids, attention_mask)[rows, cols])

    def trainable_state_dict(self) -> dict[str, torch.Tensor]:
        return {k: v for k, v in self.state_dict().items()
                if k.startswith("head.") or "lora_" in k}
