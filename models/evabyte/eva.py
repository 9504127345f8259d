"""Exact EVA attention for decoding EvaByte, in plain PyTorch, behind the decoder's cache interface.

EvaByte's attention (EVA, `evabyte_hf/eva_pt_ref.py` of github.com/OpenEvaByte/evabyte) splits the
sequence into windows of W positions and each window into chunks of C. A query at position p
attends, in ONE softmax, to
- the exact keys and values of p's own window, positions up to p (causal), and
- one summary key and value per chunk of every FINISHED window before p's:
  k_bar = sum_j softmax_j(mu . k_j) k_j and v_bar = sum_j softmax_j(s (phi . k_j - |k_j|^2 / 2)) v_j
  over the chunk's keys k_j (after rotary) and values v_j, with the layer's `adaptive_mu_k` (mu),
  `adaptive_phi` (phi) and s = head_dim^-1/2 (random-feature dimension 1).
Inside the first window this is plain causal attention; past it, it is not.

EvaByte's own `EvaCache` takes one byte after the cache and no dense mask, so the decoder cannot
verify a draft on it. `EvaWindowCache` holds, per layer, the summaries of the finished windows and
the exact K/V of the current one; `EvaBody` runs EvaByteModel's layers (their own weights, norms,
rotary tables and residual rules) over a step with a dense mask over [summaries | window | step]:
- a tree or chain step is masked by the decoder's 4D tree mask restricted to the step's own rows
  (every node sees all summaries and the whole committed window);
- commit is the decoder's rollback (`compact`): the accepted path's K/V move into place in the
  window, the rest is overwritten by the next step;
- a full window is compressed into its chunk summaries when a later position first needs it (not
  when it fills: MTPC's Algorithm 2 may still remove a re-fed root from it);
- a step's nodes must lie in one window (`draft_room`: drafts stop at the window end), and a
  longer prompt is prefilled in window-aligned blocks within the one forward.
The real forward and this port agree to about 1e-5 in fp32 (tests/models/test_evabyte_real.py).
"""

from __future__ import annotations

import torch
from transformers.modeling_outputs import BaseModelOutputWithPast

MASK_MIN_VALUE = -10e10  # eva_pt_ref.py's fill for masked scores


def draft_room(position: int, window: int) -> int:
    """Draft nodes a step whose root sits at `position` may hold: its nodes must stay in the
    root's window (a root at a window's last position may draft nothing)."""
    return window - 1 - position % window


class EvaWindowCache:
    """Per layer: summary keys/values [B, H, S, D] of the finished windows (S = their chunks) and
    the exact keys/values [B, H, n, D] of the current window, row j holding position `start + j`,
    followed by the rows of the step in flight. `length` positions are kept (the decoder's
    `DecodeCache`), `start` of them summarised (a multiple of W). Tensors are replaced, never
    written in place (a cat of at most a window and a step per layer), so gradients flow
    through the draft layers in training. `hf` is what the body takes as `past_key_values`:
    the cache itself."""

    def __init__(self, num_layers: int, window: int, chunk: int, upload=None):
        if window % chunk:
            raise ValueError(f"EVA window {window} is not a multiple of its chunk {chunk}")
        self.num_layers, self.window, self.chunk = num_layers, window, chunk
        self.upload = upload
        self.length = 0
        self.start = 0
        self.summary_k: list[torch.Tensor | None] = [None] * num_layers
        self.summary_v: list[torch.Tensor | None] = [None] * num_layers
        self.keys: list[torch.Tensor | None] = [None] * num_layers
        self.values: list[torch.Tensor | None] = [None] * num_layers
        self.hf = self

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.length

    def reserve(self, rows: int) -> None:
        pass  # the window's tensors are rebuilt every step (a window and a step at most)

    def compact(self, keep: int, accepted: list[int]) -> None:
        if keep < self.start:  # a chain step crossed the window end: fine only if kept up to it, in place
            if list(accepted[: self.start - keep]) != list(range(keep, self.start)):
                raise ValueError(f"EVA cache: cannot roll back to {keep}: a step crossed the window end at "
                                 f"{self.start}, whose window is summarised; drafts must stop at the window end "
                                 "(`draft_room`)")
            accepted, keep = accepted[self.start - keep:], self.start
        n, at = len(accepted), keep - self.start
        index = None
        if n and accepted != list(range(keep, keep + n)):
            rows = [a - self.start for a in accepted]
            index = self.upload(rows) if self.upload else torch.tensor(rows, device=self.keys[0].device)
        for i in range(self.num_layers):
            if self.keys[i] is None:
                continue
            if index is None:
                self.keys[i], self.values[i] = self.keys[i][..., : at + n, :], self.values[i][..., : at + n, :]
            else:
                self.keys[i] = torch.cat([self.keys[i][..., :at, :], self.keys[i][..., index, :]], dim=-2)
                self.values[i] = torch.cat([self.values[i][..., :at, :], self.values[i][..., index, :]], dim=-2)
        self.length = keep + n
        if at + n > self.window:
            raise ValueError(f"EVA cache: {at + n} positions kept in a window of {self.window}")

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A block's keys/values [B, H, q, D] after the committed window (replacing the rows of an
        earlier step in flight); the window's keys and values with them [B, H, n_w + q, D]."""
        at = self.length - self.start
        if self.keys[layer] is not None and at:
            k = torch.cat([self.keys[layer][..., :at, :], k], dim=-2)
            v = torch.cat([self.values[layer][..., :at, :], v], dim=-2)
        self.keys[layer], self.values[layer] = k, v
        return k, v

    def compress(self, layers) -> None:
        """The full current window -> its chunk summaries, appended per layer (`layers[i]` the
        decoder layer whose attention parameters summarise layer i); the window empties."""
        W = self.window
        for i, layer in enumerate(layers):
            k_bar, v_bar = summarise(layer.self_attn, self.keys[i][..., :W, :], self.values[i][..., :W, :], self.chunk)
            if self.summary_k[i] is not None:
                k_bar = torch.cat([self.summary_k[i], k_bar], dim=-2)
                v_bar = torch.cat([self.summary_v[i], v_bar], dim=-2)
            self.summary_k[i], self.summary_v[i] = k_bar, v_bar
            self.keys[i], self.values[i] = self.keys[i][..., W:W, :], self.values[i][..., W:W, :]
        self.start += W


def summarise(attn, k: torch.Tensor, v: torch.Tensor, chunk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One summary key and value [B, H, W / C, D] per chunk of a window's keys/values [B, H, W, D],
    as `EvaAttention._generate_feature_map` and `_calculate_chunk_rfa_cache` compute them."""
    B, H, W, D = k.shape
    rf_k, rf_v = k.reshape(B, H, W // chunk, chunk, D), v.reshape(B, H, W // chunk, chunk, D)
    mixed = attn.config.mixedp_attn
    logits = torch.sum(attn.adaptive_mu_k.to(rf_k.dtype) * rf_k, dim=-1, keepdim=True)  # [B, H, c, C, 1]
    if mixed:
        logits = logits.to(torch.float)
    k_bar = torch.sum(torch.softmax(logits, dim=-2).to(rf_k.dtype) * rf_k, dim=-2)
    proj = torch.sum(attn.adaptive_phi.to(rf_k.dtype) * rf_k, dim=-1, keepdim=True)
    norm = torch.sum(rf_k ** 2, dim=-1, keepdim=True) * 0.5
    if mixed:
        proj, norm = proj.to(torch.float), norm.to(torch.float)
    log_phi = attn.head_dim_scaling * (proj - norm)
    v_bar = torch.sum(torch.softmax(log_phi, dim=-2).to(rf_k.dtype) * rf_v, dim=-2)
    return k_bar, v_bar


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.split(x.shape[-1] // 2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def attend(layer, index: int, hidden: torch.Tensor, cos, sin, own: torch.Tensor | None,
           cache: EvaWindowCache) -> torch.Tensor:
    """One EvaByteDecoderLayer over a block of q positions of one window: hidden [B, q, d] ->
    [B, q, d], its keys/values written to the cache. `own` [q, q]: which of the block's rows each
    row sees (None: causal)."""
    attn, config = layer.self_attn, layer.config
    B, q, _ = hidden.shape
    residual = hidden.float() if config.fp32_skip_add else hidden
    x = layer.input_layernorm(hidden)
    shape = (B, q, attn.num_heads, attn.head_dim)
    qs, ks, vs = (p(x).view(shape).transpose(1, 2) for p in (attn.q_proj, attn.k_proj, attn.v_proj))
    qs, ks = qs * cos + rotate_half(qs) * sin, ks * cos + rotate_half(ks) * sin
    keys, values = cache.write(index, ks, vs)  # [B, H, n_w + q, D]
    n_w = keys.shape[-2] - q
    if own is None:
        own = torch.ones(q, q, dtype=torch.bool, device=hidden.device).tril()
    visible = torch.cat([own.new_ones(q, n_w), own], dim=-1)
    if cache.summary_k[index] is not None:
        keys = torch.cat([cache.summary_k[index], keys], dim=-2)
        values = torch.cat([cache.summary_v[index], values], dim=-2)
        visible = torch.cat([own.new_ones(q, cache.summary_k[index].shape[-2]), visible], dim=-1)
    scores = torch.matmul(qs, keys.transpose(-2, -1))
    if config.mixedp_attn:
        scores = scores.to(torch.float)
    scores = (scores * attn.head_dim_scaling).masked_fill(~visible, MASK_MIN_VALUE)
    out = torch.matmul(torch.softmax(scores, dim=-1).to(qs.dtype), values)   # [B, H, q, D]
    out = attn.o_proj(out.transpose(1, 2).reshape(B, q, attn.hidden_size))
    hidden = (residual + out).to(out.dtype)
    residual = hidden.float() if config.fp32_skip_add else hidden
    out = layer.mlp(layer.post_attention_layernorm(hidden))
    return (residual + out).to(out.dtype)


def blocks(cache: EvaWindowCache, position_ids: torch.Tensor, own: torch.Tensor | None) -> list[tuple[int, int]]:
    """The step's rows cut at window ends: [(first, end)]. Every block but the last must be a
    causal chain seen whole by every later row (a prompt); the last holds the root and its
    drafts, all in one window. Positions are read to the host only when the step may cross."""
    W, Q = cache.window, position_ids.shape[-1]
    filled = (cache.length - cache.start) % W  # a full window (W) is compressed before the step: 0
    if filled + Q <= W:
        return [(0, Q)]
    positions = position_ids[0].tolist()
    cuts = [0] + [i for i in range(1, Q) if positions[i] // W != positions[i - 1] // W] + [Q]
    out = list(zip(cuts[:-1], cuts[1:]))
    for first, end in out[:-1]:
        chain = positions[first:end] == list(range(cache.length + first, cache.length + end))
        if own is not None:
            want = torch.ones(Q - first, end - first, dtype=torch.bool, device=own.device).tril()
            chain = chain and torch.equal(own[first:, first:end], want)
        if not chain:
            raise ValueError(f"EVA: a step's nodes cross the window end (W = {W}, positions {positions[0]}.."
                             f"{max(positions)}); drafts must stop at the window end (`draft_room`)")
    first, end = out[-1]
    if min(positions[first:end]) // W != max(positions[first:end]) // W:
        raise ValueError(f"EVA: a step's nodes cross the window end (W = {W})")
    return out


def run_layers(layers, rotary, cache: EvaWindowCache, hidden: torch.Tensor, position_ids: torch.Tensor,
               own: torch.Tensor | None = None, commit: bool = False,
               states: list | None = None) -> torch.Tensor:
    """hidden [B, Q, d] through `layers` (layer i on the cache's layer i) at position_ids [B, Q],
    block by window (`blocks`). Earlier blocks are committed (a prompt), the last one is left to
    the decoder's `compact` unless `commit`. `states`, when given, gets each layer's input [B, Q, d]."""
    W, Q = cache.window, hidden.shape[1]
    cos_all, sin_all = rotary(hidden, seq_len=cache.length + Q)  # [>= length + Q, D]: any node's position
    parts, inputs = [], [[] for _ in layers]
    spans = blocks(cache, position_ids, own)
    for b, (first, end) in enumerate(spans):
        if cache.length - cache.start == W:  # the window is full and a later position needs it
            cache.compress(layers)
        h = hidden[:, first:end]
        pos = position_ids[:, first:end]
        cos, sin = cos_all[pos].unsqueeze(1), sin_all[pos].unsqueeze(1)  # [B, 1, q, D]
        mask = None if own is None else own[first:end, first:end]
        for i, layer in enumerate(layers):
            inputs[i].append(h)
            h = attend(layer, i, h, cos, sin, mask, cache)
        parts.append(h)
        if b < len(spans) - 1 or commit:
            cache.length += end - first
    if states is not None:
        states.extend(torch.cat(x, dim=1) for x in inputs)
    return torch.cat(parts, dim=1) if len(parts) > 1 else parts[0]


def own_rows(attention_mask: torch.Tensor | None, past: int) -> torch.Tensor | None:
    """The step's own rows of a 4D additive mask [1, 1, Q, past + Q] as a boolean [Q, Q] (None:
    causal). Every row sees the whole past: the EVA state summarises what it cannot hold."""
    if attention_mask is None:
        return None
    if attention_mask.dim() != 4:
        raise ValueError(f"EVA decoding takes a 4D tree mask or None, not a {attention_mask.dim()}D mask")
    return attention_mask[0, 0, :, past:] == 0


class EvaBody(torch.nn.Module):
    """EvaByteModel as the decoder calls its body. With an `EvaWindowCache` as `past_key_values`:
    exact EVA over the step (above), `inputs_embeds` or `input_ids`, a 4D tree mask or None.
    Without a cache: the model's own forward on `input_ids` (bit-identical to `model(ids)`), or
    this port on a fresh cache for `inputs_embeds` (EvaByteModel.forward reads `input_ids.shape`
    even when given embeddings only)."""

    def __init__(self, model):
        super().__init__()
        self.model = model  # EvaByteModel

    @property
    def layers(self):
        return self.model.layers

    @property
    def norm(self):
        return self.model.norm

    @property
    def rotary_emb(self):
        return self.model.rotary_emb

    @property
    def embed_tokens(self):
        return self.model.embed_tokens

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, past_key_values=None,
                inputs_embeds=None, use_cache=None, output_hidden_states=False, **kwargs):
        if past_key_values is None and inputs_embeds is None:
            return self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                              use_cache=False, output_hidden_states=output_hidden_states, return_dict=True)
        if past_key_values is None:
            if attention_mask is not None and not bool(attention_mask.bool().all()):
                raise ValueError("EVA on embeddings without a cache: no padding or tree mask")
            attention_mask = None
            config = self.model.config
            past_key_values = EvaWindowCache(len(self.layers), config.window_size, config.chunk_size)
        elif not isinstance(past_key_values, EvaWindowCache):
            raise TypeError(f"EvaByte decodes on its EVA cache (EvaWindowCache), not {type(past_key_values).__name__}: "
                            "mtpkit's decoder makes one for an evabyte model (`new_cache`), on the eager step")
        hidden = self.model.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        B, Q = hidden.shape[:2]
        past = past_key_values.length
        if position_ids is None:
            position_ids = torch.arange(past, past + Q, device=hidden.device)[None].expand(B, -1)
        states = [] if output_hidden_states else None
        hidden = run_layers(self.layers, self.rotary_emb, past_key_values, hidden, position_ids,
                            own_rows(attention_mask, past), states=states)
        hidden = self.norm(hidden)
        return BaseModelOutputWithPast(last_hidden_state=hidden, past_key_values=past_key_values,
                                       hidden_states=tuple(states) + (hidden,) if states is not None else None)
