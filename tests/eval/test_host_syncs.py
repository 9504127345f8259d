"""Host reads and host-to-device copies per decoding step on the device path (`Target.cpu_paths`
off, run here on a CPU).

On a GPU every read of a device tensor to the host (`.item()`, `.tolist()`, `bool()`, `int()`,
`.cpu()`, `.numpy()`, `nonzero`, `torch.equal`, ...) makes the host wait for the device. The
decoder may read the acceptance decision once per step. These tests count every such call during
`decode`, step by step, reads of host data included, so a count bounds the real syncs from
above. Bounds per greedy step:

    ar           1 = the acceptance read (every row's argmax)
    probe        2 = acceptance + the masks' top-k (one read for every depth of the tree)
    gated_lora   1 = acceptance (the speculations are rows of the argmax already read)
    gated_lora   2 with the sampler: + the k chained speculations, read once
    mtpc         2 = acceptance + the drafted window

Host-to-device copies go through `Target.upload` (pinned and non-blocking on a GPU); they are
counted too: AR makes none after its first step (the next input is a view of the target's own
argmax), a drafter at most 2 (its host-built draft tokens and the accepted path's cache index).

Oracle drafters get long acceptances, so a read per accepted node would break the bounds; they
corrupt their drafts with Python's `random`, so they add no reads of their own.
"""

import pytest
import torch

from mtpkit.models.decoding.decoder import Target, decode
from mtpkit.models.decoding.drafter import Drafter
from mtpkit.models.decoding.host_reads import counting_reads
from mtpkit.models.gated_lora.drafter import GatedLoRADraftConfig
from mtpkit.models.mtpc.drafter import MTPCDraftConfig, MTPCDrafter
from mtpkit.models.probe import ProbeConfig, ProbeDrafter
from tests.eval.test_gated_decoding import OracleGated
from tests.eval.test_mtpc_decoding import make_head
from tests.models.test_gated_lora import make_gated

BOUNDS = {"ar": 1, "probe": 2, "gated_lora": 1, "gated_lora_sampler": 2, "mtpc": 2}


UPLOADS = 2  # host-to-device copies a drafter's step may make (AR: 0 after the first step)


def device_target(model, gate=None) -> Target:
    target = Target(model, gate)
    target.cpu_paths = False  # the device path, on this CPU
    return target


def reads_per_step(target, drafter, prompt, new_tokens=40):
    with counting_reads(drafter, target) as steps:
        result = decode(target, drafter, prompt, new_tokens)
    return steps, result


class OracleProbe(ProbeDrafter):
    """The real probe drafter (masks, tree building, its top-k read) whose mask distributions are
    replaced by ones peaked on the true continuation, so its trees hold the AR path."""

    def __init__(self, truth, config=ProbeConfig(bc=30)):
        super().__init__(config)
        self.truth = truth

    def begin(self, target, prompt_ids):
        super().begin(target, prompt_ids)
        self.start = len(prompt_ids)

    def propose(self, tokens):
        done = len(tokens) - self.start
        upcoming = self.truth[done: done + self.k]
        if self.dists is not None and len(upcoming) == self.k:
            peaked = torch.nn.functional.one_hot(torch.tensor(upcoming), self.table.shape[0]).float()
            self.dists = (0.9 * peaked + 0.1 / self.table.shape[0]).to(self.table.device)
        return super().propose(tokens)


PROMPT = list(range(10, 30))


def test_ar_reads_once_per_step(tiny):
    target = device_target(tiny[0])
    steps, result = reads_per_step(target, Drafter(), PROMPT)
    assert result.target_calls == len(steps) == 40
    assert max(steps) <= BOUNDS["ar"], steps
    assert max(steps.uploads) == 0 and target.uploads == 1, steps.uploads  # the prompt, then none


def test_probe_reads_at_most_four_times_per_step(tiny):
    truth = decode(Target(tiny[0]), Drafter(), PROMPT, 40).tokens
    steps, result = reads_per_step(device_target(tiny[0]), OracleProbe(truth), PROMPT)
    assert result.tokens == truth and sum(result.accept_counts) > 5
    assert max(steps) <= BOUNDS["probe"], steps
    assert max(steps.uploads) <= UPLOADS, steps.uploads


@pytest.mark.parametrize("sampler", [False, True])
def test_gated_lora_reads_per_step(tiny, sampler):
    gated = make_gated(tiny[0], k=3, rank=4, seed=5)
    truth = decode(Target(tiny[0]), Drafter(), PROMPT, 40).tokens
    drafter = OracleGated(truth, GatedLoRADraftConfig(decoding="quadratic", sampler=sampler), gated, seed=1)
    steps, result = reads_per_step(device_target(*drafter.adapt(None, {})), drafter, PROMPT)
    assert result.tokens == truth and sum(result.accept_counts) > 5
    assert max(steps) <= BOUNDS["gated_lora_sampler" if sampler else "gated_lora"], steps
    assert max(steps.uploads) <= UPLOADS, steps.uploads


@pytest.mark.parametrize("arch,L", [("cp", 0), ("btree", 0), ("btree", 1)])
def test_mtpc_reads_per_step(tiny_byte, arch, L):
    """The real drafter (its windows do get accepted on the tiny byte model)."""
    backbone = tiny_byte[0]
    prompt = list(range(40, 60))
    truth = decode(Target(backbone), Drafter(), prompt, 40).tokens
    drafter = MTPCDrafter(MTPCDraftConfig(), model=make_head(backbone, arch, L))
    steps, result = reads_per_step(device_target(backbone), drafter, prompt)
    assert result.tokens == truth
    assert max(steps) <= BOUNDS["mtpc"], steps
    assert max(steps.uploads) <= UPLOADS, steps.uploads


def test_the_counter_sees_a_read_per_accepted_node(tiny, monkeypatch):
    """The CPU's lazy path (a large head's; device_rows=0 here) reads one argmax per visited node:
    the same oracle run breaks the bound there, so the counter does see reads that grow with
    acceptance."""
    truth = decode(Target(tiny[0]), Drafter(), PROMPT, 40).tokens
    target = Target(tiny[0], device_rows=0)
    assert target.cpu_paths
    steps, result = reads_per_step(target, OracleProbe(truth), PROMPT)
    assert result.tokens == truth
    assert max(steps) > BOUNDS["probe"], steps
