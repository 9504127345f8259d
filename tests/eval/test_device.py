"""The device path (what a GPU runs: `Target.cpu_paths` off, forced here on a CPU) is lossless:
for every drafter, greedy output identical to AR and to the CPU path, with drafts accepted; the
CPU-only paths switch off (`cpu_paths`); `--device cuda` without a GPU is a one-line error."""

import copy

import pytest
import torch

import mtpkit.eval.bench as bench
import mtpkit.eval.bench_generate as bench_generate
from mtpkit.models.decoding.decoder import Target, decode
from mtpkit.models.decoding.drafter import Draft, Drafter
from mtpkit.models.gated_lora.drafter import GatedLoRADraftConfig, GatedLoRADrafter
from mtpkit.models.mtpc.drafter import MTPCDraftConfig, MTPCDrafter
from mtpkit.models.packed_linear import cpu_paths, packable
from mtpkit.models.pld import PLDConfig, PLDDrafter, lookup
from mtpkit.models.probe import ProbeConfig, ProbeDrafter
from tests.eval.test_decoder import OracleDrafter, _check_step_outputs
from tests.eval.test_gated_decoding import OracleGated
from tests.eval.test_host_syncs import OracleProbe
from tests.eval.test_mtpc_decoding import OracleMTPC, make_head
from tests.models.test_gated_lora import make_gated

PROMPTS = [list(range(10, 30))]
NEW = 24


def device_target(model, gate=None) -> Target:
    target = Target(model, gate)
    target.cpu_paths = False
    return target


def runs(result):
    """What must not depend on the path: the tokens and every acceptance statistic."""
    return {k: getattr(result, k) for k in ("tokens", "target_calls", "accept_counts", "draft_nodes", "forward_tokens")}


def check_both_paths(model, gate, make_drafter, prompts=PROMPTS, new=NEW):
    """For each prompt: the device path equals the CPU path (tokens and statistics) and AR;
    returns the draft tokens accepted on the device path."""
    accepted = 0
    for prompt in prompts:
        want = decode(Target(model), Drafter(), prompt, new).tokens
        assert decode(device_target(model), Drafter(), prompt, new).tokens == want, "device-path AR differs"
        on_cpu = decode(Target(model, gate), make_drafter(want, prompt), prompt, new)
        on_device = decode(device_target(model, gate), make_drafter(want, prompt), prompt, new)
        assert on_device.tokens == want, "device path not lossless"
        assert runs(on_device) == runs(on_cpu), "device path and CPU path decoded differently"
        accepted += sum(on_device.accept_counts)
    return accepted


def test_oracle_trees_with_extra_nodes(tiny):
    """Random trees holding the AR path, wrong siblings and extra nodes: accepted exactly the
    correct prefix every step, as on the CPU path."""
    model, tokenizer = tiny
    for seed in range(2):
        prompt = PROMPTS[0]
        want = decode(Target(model), Drafter(), prompt, NEW).tokens
        oracle = OracleDrafter(want, model.config.vocab_size, seed)
        result = decode(device_target(model), oracle, prompt, NEW)
        assert result.tokens == want and result.tau > 1.5
        _check_step_outputs(oracle)


class OraclePLD(PLDDrafter):
    """Prompt lookup over the AR reference (prompt + continuation) placed before the sequence:
    its n-grams then find what truly follows."""

    def __init__(self, reference):
        super().__init__(PLDConfig(draft_len=4))
        self.reference = reference

    def propose(self, tokens):
        c = self.config
        return Draft.chain(lookup(torch.tensor(self.reference + tokens), c.ngram_max, c.ngram_min, c.draft_len))


def test_pld(tiny):
    check_both_paths(tiny[0], None, lambda want, prompt: PLDDrafter(PLDConfig(draft_len=4)))
    accepted = check_both_paths(tiny[0], None, lambda want, prompt: OraclePLD(prompt + want))
    assert accepted > 0


@pytest.mark.parametrize("config", [ProbeConfig(bc=30, init="sample"), ProbeConfig(bc=30, tree="7-2", masks=2)])
def test_probe(tiny, config):
    check_both_paths(tiny[0], None, lambda want, prompt: ProbeDrafter(config))  # the real drafter (few acceptances)
    accepted = check_both_paths(tiny[0], None, lambda want, prompt: OracleProbe(want, config))
    assert accepted > 0


@pytest.mark.parametrize("decoding,sampler", [("linear", False), ("quadratic", True)])
def test_gated_lora(tiny, decoding, sampler):
    gated = make_gated(tiny[0], k=3, rank=4, seed=5)
    config = GatedLoRADraftConfig(decoding=decoding, sampler=sampler)
    model, gate = GatedLoRADrafter(config, model=gated).adapt(None, {})
    check_both_paths(model, gate, lambda want, prompt: GatedLoRADrafter(config, model=gated))  # the real drafter
    accepted = check_both_paths(model, gate, lambda want, prompt: OracleGated(want, config, gated, seed=len(prompt)))
    assert accepted > 0


@pytest.mark.parametrize("arch,L", [("ff", 0), ("cp", 1), ("hmm", 0), ("btree", 0), ("btree", 1)])
def test_mtpc(tiny_byte, arch, L):
    backbone = tiny_byte[0]
    head = make_head(backbone, arch, L)
    prompts = [list(range(40, 60))]
    check_both_paths(backbone, None, lambda want, prompt: MTPCDrafter(MTPCDraftConfig(), model=head), prompts)
    accepted = check_both_paths(backbone, None, lambda want, prompt: OracleMTPC(want, head, seed=len(prompt)), prompts)
    assert accepted > 0


def test_mtpc_sampling_takes_the_torch_path_off_the_cpu(tiny_byte, monkeypatch):
    """BTree speculative sampling: numpy bookkeeping (`LazyBTree`) on the CPU path only."""
    backbone = tiny_byte[0]
    head = make_head(backbone, "btree", 0)

    def no_numpy(*args, **kwargs):
        raise AssertionError("LazyBTree (numpy) used")
    monkeypatch.setattr("mtpkit.models.mtpc.drafter.LazyBTree", no_numpy)
    result = decode(device_target(backbone), MTPCDrafter(MTPCDraftConfig(), model=head), [40, 41, 42], 30,
                    temperature=1.0, generator=torch.Generator().manual_seed(0))
    assert len(result.tokens) == 30 and result.draft_nodes > 0
    with pytest.raises(AssertionError, match="LazyBTree"):
        decode(Target(backbone), MTPCDrafter(MTPCDraftConfig(), model=head), [40, 41, 42], 30, temperature=1.0,
               generator=torch.Generator().manual_seed(0))


def test_what_is_packed_on_and_off_the_cpu(tiny, monkeypatch):
    """CPU layers with oneDNN (any `linear` but stock); off the CPU only `auto` packs (a GPU's
    F.linear groups, tested in tests/models/test_packed_linear.py), and the meta device never."""
    monkeypatch.setattr("mtpkit.models.packed_linear.MIN_PACK", 0)
    assert cpu_paths("cpu") and cpu_paths(torch.device("cpu")) and not cpu_paths("cuda:0")
    model = tiny[0]
    assert packable(model) and packable(model, linear="onednn") and packable(model, linear="stock") == []
    assert packable(copy.deepcopy(model).to("meta")) == []


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is present")
@pytest.mark.parametrize("main,name", [(bench.main, "bench"), (bench_generate.main, "bench_generate")])
def test_device_cuda_without_a_gpu_is_a_one_line_error(main, name, tmp_path):
    with pytest.raises(SystemExit) as e:
        main(["--backbone", "tiny-llama-random", "--device", "cuda", "--out", str(tmp_path / "r.json")])
    message = str(e.value.code)
    assert message.startswith(f"{name}: --device cuda: no CUDA device") and "\n" not in message, message
