"""The drafter whose trees the tree search (`eval/tree_frontier.py --method`) searches: a
gated-LoRA head, the training-free probe, an MTPC circuit head or Medusa / Hydra heads, each with
its teacher-forced pass (`mtpkit.eval.tree_search.calibration`), the target its steps are priced
on, and a drafter decoding one tree of a bank (the held-out check)."""

from __future__ import annotations

import copy
import json
import sys
from dataclasses import dataclass
from typing import Callable

from mtpkit.eval.tree_search.calibration import (Calibration, calibrate, calibrate_heads, calibrate_mtpc,
                                                 calibrate_probe)
from mtpkit.models.decoding.decoder import Target
from mtpkit.models.decoding.drafter import Drafter
from mtpkit.models.gated_lora.head import load_head
from mtpkit.models.kernel_plan import pack_targets


@dataclass
class Subject:
    """The drafter whose trees are searched: masks per block `k`, its teacher-forced pass, the
    target its steps are timed on, and a drafter decoding with tree `index` of a bank file."""
    k: int
    calibrate: Callable[[list[int], int, str], Calibration]
    target: Target
    drafter: Callable[[str, int], tuple[Drafter, Target]]
    candidates: Callable
    """the drafter's `candidates(step, rows, compiled)`: a tree's tokens from a mask block"""
    settings: dict
    masks: bool = True
    """whether a step carries mask blocks (False: MTPC, whose next tree comes from the last state)"""
    kernels: dict | None = None
    """`pack_targets`' record: the kernel plans the targets were packed and tuned with (None: none)"""
    chains_only: bool = False
    """only chains are simulated (MTPC under sampling, `rollout_sampled`): no tree growth"""


def gated_subject(args, base) -> Subject:
    from mtpkit.models.gated_lora.drafter import GatedLoRADraftConfig, GatedLoRADrafter

    if not args.head:
        sys.exit("tree_frontier: --method gated_lora needs --head DIR (a gated-LoRA head folder)")
    model = load_head(args.head, copy.deepcopy(base)).to(base.device).eval()  # the head's weights load on the CPU
    lean = _lean(model)
    # the drafter resolves --sampler (auto: the sampler when the head has one) and refuses 1 without
    # one; its candidates time drafting
    try:
        plain = GatedLoRADrafter(GatedLoRADraftConfig(head=args.head, sampler=args.sampler), model=lean)
    except ValueError as e:
        sys.exit(f"tree_frontier: --sampler {args.sampler}: {e}")
    sampler = plain.use_sampler
    adapted = plain.adapt(None, {})
    kernels = pack_targets(base, [adapted[0]], args.linear, retune=args.retune)  # `model` (calibration) stays as trained
    target = Target(*adapted)

    def drafter(bank: str, index: int):  # decodes on the same adapted copy, so on `target`
        return GatedLoRADrafter(GatedLoRADraftConfig(tree=bank, index=index, sampler=args.sampler),
                                model=lean), target

    return Subject(model.config.k,
                   lambda ids, P, task: calibrate(model, ids, P, task, sampler, args.max_rank),
                   target, drafter, plain.candidates,
                   {"head": args.head, "sampler": sampler}, kernels=kernels)


def probe_subject(args, base) -> Subject:
    from mtpkit.models.probe import ProbeConfig, ProbeDrafter

    k = args.masks or 3
    options = dict(masks=k, init=args.init, lam=args.lam)
    kernels = pack_targets(base, (), args.linear, retune=args.retune)
    plain = Target(base)
    probe = ProbeDrafter(ProbeConfig(tree=f"chain{k}", **options))

    def drafter(bank: str, index: int):
        return ProbeDrafter(ProbeConfig(tree=bank, index=index, **options)), plain

    return Subject(k, lambda ids, P, task: calibrate_probe(plain, probe, ids, P, task, args.max_rank),
                   plain, drafter, probe.candidates,
                   {"head": f"probe (init {args.init}, lambda {args.lam})", "sampler": False}, kernels=kernels)


def mtpc_subject(args, base) -> Subject:
    from mtpkit.models.mtpc.drafter import MTPCDraftConfig, MTPCDrafter
    from mtpkit.models.mtpc.head import load_head as load_mtpc_head

    if not args.head:
        sys.exit("tree_frontier: --method mtpc needs --head DIR (an MTPC head folder)")
    model = load_mtpc_head(args.head, base).to(base.device).eval()
    depth = args.max_depth or min(8, model.cfg.n)
    if not 0 < depth <= model.cfg.n:
        sys.exit(f"tree_frontier: --max-depth {depth}: the head's window is {model.cfg.n}")
    kernels = pack_targets(base, (), args.linear, retune=args.retune)
    target = Target(base)
    timed: dict[str, MTPCDrafter] = {}

    def drafter(bank: str, index: int):
        return MTPCDrafter(MTPCDraftConfig(tree=bank, index=index), model=model), target

    def candidates(step, rows, compiled):  # the drafter's own tree drafting from the root's state (greedy or sampled)
        tree = compiled.topology
        if tree.name not in timed:
            timed[tree.name] = MTPCDrafter(MTPCDraftConfig(tree=json.dumps([list(p) for p in tree.paths])), model=model)
            timed[tree.name].sampling = args.temperature > 0
            timed[tree.name].begin(target, [])
        d = timed[tree.name]
        d.e, d.given = step.hidden[0], []
        return [int(t) for t in d.propose([]).tokens]

    return Subject(depth, lambda ids, P, task: calibrate_mtpc(model, target, ids, P, task, depth, args.max_rank,
                                                              temperature=args.temperature, top_p=args.top_p),
                   target, drafter, candidates, {"head": args.head, "sampler": False, "arch": model.cfg.arch},
                   masks=False, chains_only=args.temperature > 0, kernels=kernels)


def medusa_subject(args, base) -> Subject:
    """Medusa or Hydra heads (--method medusa | hydra): no mask blocks; a tree's depth is at most
    the head count."""
    from mtpkit.models.medusa import MedusaDraftConfig, MedusaDrafter, load_head as load_medusa_head

    if not args.head:
        sys.exit(f"tree_frontier: --method {args.method} needs --head DIR (a {args.method} head folder)")
    heads = load_medusa_head(args.head, base).to(base.device).eval()
    if heads.cfg.arch != args.method:
        sys.exit(f"tree_frontier: --head {args.head} holds {heads.cfg.arch} heads; use --method {heads.cfg.arch}")
    kernels = pack_targets(base, (), args.linear, retune=args.retune)
    target = Target(base)
    timed: dict[str, MedusaDrafter] = {}

    def drafter(bank: str, index: int):
        return MedusaDrafter(MedusaDraftConfig(tree=bank, index=index), model=heads), target

    def candidates(step, rows, compiled):  # the drafter's own drafting from the root's state
        tree = compiled.topology
        if tree.name not in timed:
            timed[tree.name] = MedusaDrafter(MedusaDraftConfig(tree=json.dumps([list(p) for p in tree.paths])),
                                             model=heads)
            timed[tree.name].begin(target, [])
        d = timed[tree.name]
        d.h, d.bonus = step.hidden[0], step.new_tokens[-1]
        tokens = d.propose([]).tokens  # on the device: read, as the verifier would
        return tokens.tolist() if hasattr(tokens, "tolist") else tokens

    return Subject(heads.cfg.heads, lambda ids, P, task: calibrate_heads(heads, target, ids, P, task, args.max_rank),
                   target, drafter, candidates, {"head": args.head, "sampler": False, "arch": heads.cfg.arch},
                   masks=False, kernels=kernels)


SUBJECTS = {"gated_lora": gated_subject, "probe": probe_subject, "mtpc": mtpc_subject, "medusa": medusa_subject,
            "hydra": medusa_subject}


def _lean(model):
    """The lean inference form (`to_inference`) of a copy of the gated model, as the bench decodes."""
    from mtpkit.models.gated_lora.inference import to_inference

    return to_inference(copy.deepcopy(model))
