"""EvaByte-class backbones through the architecture adapter (models/arch.py): a tiny random model
with EvaByte's interface, written here, not a Llama. MTPC's V is the byte vocabulary, not
V x heads; the target's next-byte logits are the first head's; the draft layers reproduce the
backbone's own states with zero LoRA; the head starts from the backbone's heads (Sec. 4.1);
greedy MTPC decoding equals AR; a few training steps lower the loss.

The tiny model follows OpenEvaByte/evabyte evabyte_hf/modeling_evabyte.py: LM head of
vocab_size x num_pred_heads rows, head-major, `forward` returning head 0 unless
`return_all_pred_logits`; decoder layers called with (hidden_states, attention_mask,
position_ids, past_key_value, output_attentions, use_cache, cos, sin, multibyte_decoding) and
returning a tuple; rotary tables from `rotary_emb(x, seq_len=past + T)`, indexed by position ids.
Its attention is exact softmax attention over a dense mask and a `DynamicCache` (standing in for
EVA and EvaCache, which mtpkit's decoder cannot drive: see docs/mtpc.md)."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from transformers import DynamicCache, PretrainedConfig, PreTrainedModel
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast

from mtpkit.models.decoding.decoder import Target, decode
from mtpkit.models.arch import EvaByteArch, LlamaArch, adapter_for
from mtpkit.models.decoding.drafter import Drafter
from mtpkit.models.mtpc import MTPCConfig, MTPCModel, window_loss, window_targets
from mtpkit.models.mtpc.circuits import log_prob
from mtpkit.models.mtpc.drafter import MTPCDraftConfig, MTPCDrafter
from tests.eval.test_mtpc_decoding import OracleMTPC

V, HEADS = 320, 8  # EvaByte: 256 bytes + 64 specials, 8 next-byte heads


class TinyEvaByteConfig(PretrainedConfig):
    model_type = "evabyte"

    def __init__(self, vocab_size=V, num_pred_heads=HEADS, hidden_size=64, intermediate_size=128,
                 num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=64, rope_theta=10000.0,
                 rms_norm_eps=1e-6, initializer_range=0.5, **kwargs):
        self.vocab_size, self.num_pred_heads = vocab_size, num_pred_heads
        self.hidden_size, self.intermediate_size = hidden_size, intermediate_size
        self.num_hidden_layers, self.num_attention_heads = num_hidden_layers, num_attention_heads
        self.max_position_embeddings, self.rope_theta = max_position_embeddings, rope_theta
        self.rms_norm_eps, self.initializer_range = rms_norm_eps, initializer_range
        super().__init__(**kwargs)


class TinyEvaByteRMSNorm(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(config.hidden_size))
        self.eps = config.rms_norm_eps

    def forward(self, x):
        x = x.float()
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))


class TinyEvaByteRotaryEmbedding(nn.Module):
    """EvaByteRotaryEmbedding: cos/sin tables [seq_len, head_dim], grown on demand."""

    def __init__(self, dim, max_position_embeddings, base):
        super().__init__()
        self.register_buffer("inv_freq", 1.0 / base ** (torch.arange(0, dim, 2).float() / dim), persistent=False)
        self._set_cos_sin_cache(max_position_embeddings)

    def _set_cos_sin_cache(self, seq_len):
        self.max_seq_len_cached = seq_len
        freqs = torch.outer(torch.arange(seq_len, dtype=self.inv_freq.dtype), self.inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos_cached", emb.cos(), persistent=False)
        self.register_buffer("sin_cached", emb.sin(), persistent=False)

    def forward(self, x, seq_len=None):
        if seq_len > self.max_seq_len_cached:
            self._set_cos_sin_cache(seq_len)
        return self.cos_cached[:seq_len].to(x.dtype), self.sin_cached[:seq_len].to(x.dtype)


def rotate_half(x):
    x1, x2 = x.split(x.shape[-1] // 2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class TinyEvaAttention(nn.Module):
    """EvaAttention's signature; exact attention. mask: None (causal, no past) or 4D additive."""

    def __init__(self, config, layer_idx):
        super().__init__()
        self.layer_idx, self.num_heads = layer_idx, config.num_attention_heads
        self.head_dim = config.hidden_size // self.num_heads
        d = config.hidden_size
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (nn.Linear(d, d, bias=False) for _ in range(4))

    def forward(self, hidden_states, attention_mask=None, position_ids=None, past_key_value=None,
                output_attentions=False, use_cache=False, cos=None, sin=None, multibyte_decoding=False):
        B, T, _ = hidden_states.shape
        q, k, v = (p(hidden_states).view(B, T, self.num_heads, self.head_dim).transpose(1, 2)
                   for p in (self.q_proj, self.k_proj, self.v_proj))
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        if use_cache:
            k, v = past_key_value.update(k, v, self.layer_idx)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=attention_mask,
                                             is_causal=attention_mask is None and T > 1)
        return self.o_proj(out.transpose(1, 2).reshape(B, T, -1)), None, past_key_value


class TinyEvaByteMLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        d, m = config.hidden_size, config.intermediate_size
        self.gate_proj, self.up_proj = nn.Linear(d, m, bias=False), nn.Linear(d, m, bias=False)
        self.down_proj = nn.Linear(m, d, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class TinyEvaByteDecoderLayer(nn.Module):
    """EvaByteDecoderLayer: pre-norm attention and MLP; returns (hidden, [attn], [cache])."""

    def __init__(self, config, layer_idx):
        super().__init__()
        self.self_attn, self.mlp = TinyEvaAttention(config, layer_idx), TinyEvaByteMLP(config)
        self.input_layernorm, self.post_attention_layernorm = TinyEvaByteRMSNorm(config), TinyEvaByteRMSNorm(config)

    def forward(self, hidden_states, attention_mask=None, position_ids=None, past_key_value=None,
                output_attentions=False, use_cache=False, cos=None, sin=None, multibyte_decoding=False):
        attn, weights, present = self.self_attn(self.input_layernorm(hidden_states), attention_mask=attention_mask,
                                                position_ids=position_ids, past_key_value=past_key_value,
                                                use_cache=use_cache, cos=cos, sin=sin)
        hidden_states = hidden_states + attn
        hidden_states = hidden_states + self.mlp(self.post_attention_layernorm(hidden_states))
        return (hidden_states,) + ((weights,) if output_attentions else ()) + ((present,) if use_cache else ())


class TinyEvaBytePreTrainedModel(PreTrainedModel):
    config_class = TinyEvaByteConfig
    base_model_prefix = "model"

    def _init_weights(self, module):
        if isinstance(module, (nn.Linear, nn.Embedding)):
            module.weight.data.normal_(0.0, self.config.initializer_range)


class TinyEvaByteModel(TinyEvaBytePreTrainedModel):
    def __init__(self, config):
        super().__init__(config)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(TinyEvaByteDecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = TinyEvaByteRMSNorm(config)
        self.rotary_emb = TinyEvaByteRotaryEmbedding(config.hidden_size // config.num_attention_heads,
                                                     config.max_position_embeddings, config.rope_theta)
        self.post_init()

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, past_key_values=None,
                inputs_embeds=None, use_cache=None, output_attentions=None, output_hidden_states=None,
                return_dict=None, multibyte_decoding=None):
        hidden = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        B, T = hidden.shape[:2]
        past = past_key_values.get_seq_length() if past_key_values is not None else 0
        if position_ids is None:
            position_ids = torch.arange(past, past + T, device=hidden.device)[None].expand(B, -1)
        if attention_mask is not None and attention_mask.dim() == 2:  # padding [B, past + T]
            allowed = torch.ones(T, past + T, dtype=torch.bool, device=hidden.device).tril(past)
            allowed = allowed[None, None] & attention_mask[:, None, None, :].bool()
            attention_mask = torch.zeros(allowed.shape, dtype=hidden.dtype).masked_fill(~allowed, -1e9)
        elif attention_mask is None and past and T > 1:
            allowed = torch.ones(T, past + T, dtype=torch.bool, device=hidden.device).tril(past)
            attention_mask = torch.zeros(allowed.shape, dtype=hidden.dtype).masked_fill(~allowed, -1e9)[None, None]
        cos, sin = self.rotary_emb(hidden, seq_len=past + T)
        cos, sin = cos[position_ids].unsqueeze(1), sin[position_ids].unsqueeze(1)
        states = ()
        for layer in self.layers:
            states += (hidden,)
            hidden = layer(hidden, attention_mask=attention_mask, position_ids=position_ids,
                           past_key_value=past_key_values, use_cache=bool(use_cache), cos=cos, sin=sin)[0]
        hidden = self.norm(hidden)
        return BaseModelOutputWithPast(last_hidden_state=hidden, past_key_values=past_key_values,
                                       hidden_states=states + (hidden,) if output_hidden_states else None)


class TinyEvaByteForCausalLM(TinyEvaBytePreTrainedModel):
    def __init__(self, config):
        super().__init__(config)
        self.model = TinyEvaByteModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size * config.num_pred_heads, bias=False)
        self.post_init()

    def get_input_embeddings(self):
        return self.model.embed_tokens

    def get_output_embeddings(self):
        return self.lm_head

    def get_decoder(self):
        return self.model

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, past_key_values=None,
                inputs_embeds=None, labels=None, use_cache=None, output_attentions=None, output_hidden_states=None,
                return_dict=None, return_all_pred_logits=None, multibyte_decoding=None):
        out = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                         past_key_values=past_key_values, inputs_embeds=inputs_embeds, use_cache=use_cache,
                         output_hidden_states=output_hidden_states)
        logits = self.lm_head(out.last_hidden_state)
        all_pred = logits.reshape(*logits.shape[:2], self.config.num_pred_heads, self.config.vocab_size)
        return CausalLMOutputWithPast(logits=all_pred if return_all_pred_logits else all_pred[..., 0, :],
                                      past_key_values=out.past_key_values, hidden_states=out.hidden_states)


@pytest.fixture(scope="module")
def tiny_eva():
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = TinyEvaByteForCausalLM(TinyEvaByteConfig())
    return model.eval()


def ids(seed, T=24, B=1):
    return torch.randint(0, 256, (B, T), generator=torch.Generator().manual_seed(seed))


def test_the_adapter_is_evabytes_and_the_vocabulary_is_bytes_not_bytes_times_heads(tiny_eva):
    adapter = adapter_for(tiny_eva)
    assert isinstance(adapter, EvaByteArch) and adapter.vocab_size == V
    assert tiny_eva.lm_head.weight.shape[0] == V * HEADS
    assert adapter.head_weights().shape == (HEADS, V, 64)
    with pytest.raises(ValueError, match="2560 rows for a vocabulary of 320"):
        LlamaArch(tiny_eva)  # the Llama assumptions refuse it, with the reason
    model = MTPCModel(tiny_eva, MTPCConfig(arch="btree", n=4, r=3))
    assert model.head.vocab_size == V and model.head.unembed.shape == (4, 3, V, 64)
    with torch.no_grad():
        assert model(ids(0), None, torch.tensor([0]), torch.tensor([5])).log_phi.shape == (1, 4, 3, V)


def test_target_next_byte_logits_are_the_first_heads(tiny_eva):
    target = Target(tiny_eva)
    x = ids(1)
    with torch.no_grad():
        hidden = target.body(input_ids=x).last_hidden_state
        mine = target.lm_head(hidden)                                                # [1, T, V]
        heads = tiny_eva(input_ids=x, return_all_pred_logits=True).logits           # [1, T, 8, V]
    assert mine.shape == (1, 24, V)
    assert torch.equal(mine, heads[..., 0, :])
    torch.testing.assert_close(mine, hidden @ tiny_eva.lm_head.weight[:V].T)   # head 0 is the first V rows
    assert not torch.allclose(mine, heads[..., 1, :])


def test_draft_layers_with_zero_lora_are_the_backbones_own_layers(tiny_eva):
    model = MTPCModel(tiny_eva, MTPCConfig(arch="btree", n=4, r=3, lora_layers=1, lora_rank=4))
    lora_b = [p for name, p in model.draft.named_parameters() if "lora_B" in name]
    assert lora_b and all(not p.any() for p in lora_b)  # peft starts B at zero
    x = ids(2, T=20)
    with torch.no_grad():
        assert torch.equal(model.features(x), tiny_eva.model(input_ids=x).last_hidden_state)  # exact
        # incremental, on the draft's own cache: the rotary tables at the right positions
        shared = tiny_eva.model(input_ids=x, output_hidden_states=True).hidden_states[model.draft.start]
        cache, parts = DynamicCache(), []
        for a, b in ((0, 7), (7, 8), (8, 20)):
            parts.append(model.draft(shared[:, a:b], torch.arange(a, b)[None], past_key_values=cache))
        torch.testing.assert_close(torch.cat(parts, 1), model.features(x), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("arch", ["ff", "cp", "hmm", "btree", "cirkit"])
def test_the_head_starts_from_the_backbones_heads(tiny_eva, arch):
    """Sec. 4.1: position i starts from EvaByte's head i (the last head past it); with n <= the
    number of heads the initial circuit is exactly the backbone's own MTP model, prod_i head_i."""
    n = 4 if arch == "cirkit" else 16
    heads = tiny_eva.lm_head.weight.detach().view(HEADS, V, 64)
    model = MTPCModel(tiny_eva, MTPCConfig(arch=arch, n=n, r=3))
    units = model.head.unembed if arch != "cirkit" else None
    if arch == "cirkit":
        for m, u in zip(model.head.categoricals, model.head.unembed):
            for f, position in enumerate(m.scope_idx[:, 0].tolist()):
                assert torch.equal(u[f], heads[position][None].expand_as(u[f]))
    else:
        for i in range(n):
            assert torch.equal(units[i], heads[min(i, HEADS - 1)][None].expand_as(units[i])), i
        off = MTPCModel(tiny_eva, MTPCConfig(arch=arch, n=n, r=3, init_from_backbone_heads=False))
        assert torch.equal(off.head.unembed, heads[0][None, None].expand_as(off.head.unembed))
    if arch in ("cp", "hmm", "btree"):  # n = 8 = the heads: the circuit is EvaByte-MTP
        model = MTPCModel(tiny_eva, MTPCConfig(arch=arch, n=8, r=3)).double()
        with torch.no_grad():
            e = tiny_eva.model(input_ids=ids(3, T=6)).last_hidden_state[0].double()  # [6, d]
            params = model.head(e)
            x = torch.randint(0, V, (6, 8), generator=torch.Generator().manual_seed(4))
            ff = (e @ heads.double().transpose(1, 2)).log_softmax(-1)  # [8, 6, V]
            want = ff.gather(-1, x.T[..., None])[..., 0].sum(0)       # sum_i log head_i(x_i)
        torch.testing.assert_close(log_prob(params, x), want)


@pytest.mark.parametrize("arch,L", [("btree", 0), ("btree", 1), ("cp", 1)])
def test_greedy_mtpc_decoding_equals_ar(tiny_eva, arch, L):
    torch.manual_seed(0)
    head = MTPCModel(tiny_eva, MTPCConfig(arch=arch, n=4, r=3, lora_layers=L, lora_rank=4))
    with torch.no_grad():  # a trained-looking head: distinct ranks, non-zero LoRA
        for p in head.parameters():
            if p.requires_grad:
                p.add_(0.3 * torch.randn_like(p))
    head.eval()
    target = Target(tiny_eva)
    prompt = ids(5, T=7)[0].tolist()
    want = decode(target, Drafter(), prompt, 40).tokens
    if arch == "btree" and L == 0:  # AR through the decoder is the model's own greedy output
        seq = list(prompt)
        with torch.no_grad():
            for _ in range(40):
                seq.append(int(tiny_eva(input_ids=torch.tensor([seq])).logits[0, -1].argmax()))
        assert seq[len(prompt):] == want
    assert decode(target, MTPCDrafter(MTPCDraftConfig(), model=head), prompt, 40).tokens == want
    got = decode(target, OracleMTPC(want, head, seed=1), prompt, 40)
    assert got.tokens == want
    assert got.accept_counts and got.accept_counts[0] > 0 and len(got.accept_counts) >= 3, got.accept_counts
    assert got.tau > 1.3


def test_training_steps_lower_the_loss(tiny_eva):
    torch.manual_seed(0)
    model = MTPCModel(tiny_eva, MTPCConfig(arch="btree", n=8, r=4, lora_layers=1, lora_rank=4))
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.Adam(trainable, lr=1e-2)
    x = ids(6, T=33, B=2)
    inputs, labels = x[:, :-1], x[:, 1:]
    targets, valid = window_targets(labels, 8)                      # [B, T, n]
    rows, cols = torch.arange(2).repeat_interleave(32), torch.arange(32).repeat(2)
    losses = []
    for _ in range(6):
        loss, _ = window_loss(model(inputs, None, rows, cols), targets[rows, cols], valid[rows, cols], rows, 2, 0.9)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert all(torch.isfinite(torch.tensor(losses))) and losses[-1] < losses[0] - 0.5, losses
    assert any(p.grad is not None and p.grad.any() for n, p in model.draft.named_parameters() if "lora_" in n)
