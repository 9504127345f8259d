"""The KV caches the decoder owns, behind one interface (`DecodeCache`).

Every step the decoder asks the cache for room (`reserve`), runs ONE target forward with `hf`
as `past_key_values` (the new rows written after the `length` kept positions), then keeps the
accepted path (`compact`): positions [0, keep) stay, the accepted positions (absolute, >= keep,
increasing) move to keep, keep+1, ... and everything after is dropped. `length` is the number
of positions kept, read by the decoder for position ids and masks.

- `SlabCache` (the runtime's): one preallocated tensor [layers, 2, batch, kv_heads, capacity,
  head_dim] for every layer's keys and values. A forward writes its rows by index and attends
  to a view of the first length + Q positions (nothing concatenated); compaction is one gather
  and one copy for all layers at once (Medusa's KV compaction); an accepted prefix that already
  sits in place costs nothing. Capacity grows by doubling when a step would not fit (the
  decoder reserves prompt + max_new_tokens + the first step's width up front, so it rarely
  does).
- `StaticSlab` (the compiled step's, gpt-fast's layout): a fixed capacity, one keys and one values
  tensor per layer (not views of one slab: `torch.compile` would copy the whole slab back after
  every write into a view of it), the length also a device scalar (`length_t`); a forward writes
  its rows by index at device positions (`index_copy_`) and attends to the WHOLE cache under a
  mask that hides the positions past the step, so every tensor of a step has a fixed shape and
  nothing in it reads the host: what a captured CUDA graph or a `torch.compile`d step needs
  (`mtpkit.models.decoding.step`). Compaction is one gather per tensor.
- `DynamicKV`: transformers' `DynamicCache`, concatenated every layer every step and rolled
  back with a cat per layer: the eager decoder's cache, kept as the exactness oracle and for
  architectures whose attention is not transformers' `Cache.update` protocol.

- `EvaWindowCache` (`mtpkit.models.evabyte.eva`): EvaByte's, whatever the kind asked for but
  `static`: per layer the chunk summaries of the finished attention windows and the exact K/V of
  the current one; compaction moves the accepted path within the window.
"""

from __future__ import annotations

from typing import Protocol

import torch
from transformers import DynamicCache
from transformers.cache_utils import Cache, CacheLayerMixin

from mtpkit.models.evabyte.eva import EvaWindowCache


class DecodeCache(Protocol):
    hf: Cache            # what the model's forward takes as past_key_values
    length: int          # positions kept (the accepted sequence so far, minus the next root)

    def reserve(self, rows: int) -> None:
        """Make room for a forward of `rows` new positions after `length`."""

    def compact(self, keep: int, accepted: list[int]) -> None:
        """Keep [0, keep) and the positions `accepted` (absolute, increasing, >= keep) moved to
        keep, keep+1, ...; `length` becomes keep + len(accepted)."""


class _SlabLayer(CacheLayerMixin):
    """One layer's view of the slab: `update` writes the step's keys/values at [length, length+Q)
    and returns views of [0, length+Q)."""

    is_sliding = False

    def __init__(self, slab: "SlabCache", index: int):
        super().__init__()
        self.slab, self.index = slab, index

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.slab._allocate(key_states)
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        slab = self.slab
        if slab.kv is None:
            slab._allocate(key_states)
        self.is_initialized = True
        start = slab.length
        end = start + key_states.shape[-2]
        kv = slab.kv[self.index]  # [2, B, H, capacity, D]
        kv[0, :, :, start:end].copy_(key_states)
        kv[1, :, :, start:end].copy_(value_states)
        return kv[0, :, :, :end], kv[1, :, :, :end]

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.slab.length + query_length, 0

    def get_seq_length(self) -> int:
        return self.slab.length

    def get_max_length(self) -> int:
        return -1


class _SlabHF(Cache):
    """The transformers face of a `SlabCache` (its layers write into the slab)."""

    def __init__(self, slab: "SlabCache", num_layers: int):
        super().__init__(layers=[_SlabLayer(slab, i) for i in range(num_layers)])


class SlabCache:
    """See the module docstring. `num_layers` from the model's config; the slab's heads, head
    width, dtype and device from the first keys written."""

    def __init__(self, num_layers: int, capacity: int = 0, upload=None):
        self.num_layers = num_layers
        self.upload = upload  # host ints -> a device index (`Target.upload`: non-blocking on a GPU)
        self.capacity = max(capacity, 1)
        self.length = 0
        self.kv: torch.Tensor | None = None
        self.hf = _SlabHF(self, num_layers)

    def _allocate(self, key_states: torch.Tensor) -> None:
        B, H, _, D = key_states.shape
        self.kv = key_states.new_empty((self.num_layers, 2, B, H, self.capacity, D))

    def reserve(self, rows: int) -> None:
        need = self.length + rows
        if need <= self.capacity:
            return
        capacity = max(need, 2 * self.capacity)
        if self.kv is not None:
            grown = self.kv.new_empty((*self.kv.shape[:4], capacity, self.kv.shape[-1]))
            grown[..., : self.length, :].copy_(self.kv[..., : self.length, :])
            self.kv = grown
        self.capacity = capacity

    def compact(self, keep: int, accepted: list[int]) -> None:
        n = len(accepted)
        if accepted != list(range(keep, keep + n)):  # an accepted prefix already in place costs nothing
            index = self.upload(accepted) if self.upload else torch.tensor(accepted, device=self.kv.device)
            self.kv[..., keep: keep + n, :].copy_(self.kv.index_select(-2, index))
        self.length = keep + n


class DynamicKV:
    """transformers' `DynamicCache`, rolled back by slicing and concatenating each layer."""

    def __init__(self, config=None, upload=None):
        self.hf = DynamicCache(config=config)
        self.upload = upload
        self.length = 0

    def reserve(self, rows: int) -> None:
        pass

    def compact(self, keep: int, accepted: list[int]) -> None:
        positions = list(accepted)
        if positions == list(range(keep, keep + len(positions))):
            keep, positions = keep + len(positions), []
        index = None
        for layer in self.hf.layers:
            if positions:
                if index is None:  # one host-to-device copy for every layer
                    index = self.upload(positions) if self.upload else torch.tensor(positions, device=layer.keys.device)
                layer.keys = torch.cat([layer.keys[..., :keep, :], layer.keys[..., index, :]], dim=-2)
                layer.values = torch.cat([layer.values[..., :keep, :], layer.values[..., index, :]], dim=-2)
            else:
                layer.keys = layer.keys[..., :keep, :]
                layer.values = layer.values[..., :keep, :]
        self.length = keep + len(positions)


class _StaticLayer(_SlabLayer):
    """One layer of a `StaticSlab`: writes at the device positions `slab.write` and returns its whole
    keys and values (the step's mask hides what lies past the step); an eager forward (a prefill,
    `write` None) writes at the host positions [length, length + Q) and gets views up to there."""

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        slab = self.slab
        if slab.keys is None:
            slab._allocate(key_states)
        self.is_initialized = True
        keys, values = slab.keys[self.index], slab.values[self.index]
        if slab.write is None:
            end = slab.length + key_states.shape[-2]
            keys[:, :, slab.length: end].copy_(key_states)
            values[:, :, slab.length: end].copy_(value_states)
            return keys[:, :, :end], values[:, :, :end]
        keys.index_copy_(-2, slab.write, key_states)
        values.index_copy_(-2, slab.write, value_states)
        return keys, values

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        if self.slab.write is None:
            return super().get_mask_sizes(query_length)
        return self.slab.capacity, 0


class StaticSlab(SlabCache):
    """See the module docstring: a cache of fixed capacity whose steps write by device index.
    `write` ([Q] device positions) is set by the step for its forward, None for an eager one;
    `length_t` follows `length` on the device (updated by a device fill, never read back)."""

    def __init__(self, num_layers: int, capacity: int, upload=None):
        super().__init__(num_layers, capacity, upload)
        self.hf = Cache(layers=[_StaticLayer(self, i) for i in range(num_layers)])
        self.keys: list[torch.Tensor] | None = None
        self.values: list[torch.Tensor] | None = None
        self.write: torch.Tensor | None = None
        self.length_t: torch.Tensor | None = None

    def _allocate(self, key_states: torch.Tensor) -> None:
        B, H, _, D = key_states.shape
        # zeros, not empty: attention reads the whole cache, and a masked position's weight (0)
        # times an uninitialised value (possibly NaN) would be NaN
        self.keys = [key_states.new_zeros((B, H, self.capacity, D)) for _ in range(self.num_layers)]
        self.values = [key_states.new_zeros((B, H, self.capacity, D)) for _ in range(self.num_layers)]
        self.length_t = torch.zeros((), dtype=torch.long, device=key_states.device)

    def reserve(self, rows: int) -> None:
        if self.length + rows > self.capacity:
            raise ValueError(f"static cache: a step of {rows} rows after {self.length} positions does not "
                             f"fit its capacity {self.capacity}; give decode a larger max_len")

    def compact(self, keep: int, accepted: list[int]) -> None:
        n = len(accepted)
        if self.keys is not None and accepted != list(range(keep, keep + n)):  # a prefix in place stays
            index = self.upload(accepted) if self.upload else torch.tensor(accepted, device=self.keys[0].device)
            for tensor in self.keys + self.values:
                tensor[:, :, keep: keep + n].copy_(tensor.index_select(-2, index))
        self.length = keep + n
        if self.length_t is not None:
            self.length_t.fill_(self.length)


CACHES = ("slab", "static", "dynamic")


def new_cache(kind: str, config, capacity: int, upload=None) -> DecodeCache:
    """A decoding cache of `kind` (`CACHES`) for a model of `config`, with room for `capacity`
    positions to begin with; `upload` (host ints -> a device long tensor) makes its gather index.
    An EvaByte model (EVA attention) decodes on its windowed EVA cache."""
    if getattr(config, "model_type", None) == "evabyte":
        if kind == "static":
            raise ValueError("EvaByte (EVA attention) decodes on its windowed EVA cache, with the eager step: "
                             "no static cache")
        if kind not in CACHES:
            raise ValueError(f"unknown cache {kind!r}; choose one of {', '.join(CACHES)}")
        return EvaWindowCache(config.num_hidden_layers, config.window_size, config.chunk_size, upload)
    if kind == "slab":
        return SlabCache(config.num_hidden_layers, capacity, upload)
    if kind == "static":
        return StaticSlab(config.num_hidden_layers, capacity, upload)
    if kind == "dynamic":
        return DynamicKV(config, upload)
    raise ValueError(f"unknown cache {kind!r}; choose one of {', '.join(CACHES)}")
