"""The held-out check of the tree search (`eval/tree_frontier.py --holdout N`, step 5): the last
N prompts of each task are kept out of calibration, growth and pricing; every bank tree is then
decoded on them through the real decoder (greedy: outputs checked against AR) and its decoded tau
compared with the simulated one (`mtpkit.eval.tree_search.simulate`). Under sampling the two taus
come from different draws, so they agree up to sampling noise; the check also replays the
decoder's own outputs and requires exactly its steps (MTPC: reports the expected steps given
those outputs against the decoder's steps)."""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

from tqdm import tqdm

from mtpkit.eval.tree_search.calibration import sampling
from mtpkit.eval.tree_search.simulate import rollout
from mtpkit.eval.tree_search.subjects import Subject
from mtpkit.models.decoding.decoder import decode
from mtpkit.models.trees import Topology


def check(subject: Subject, bank: list[Topology], held, args) -> dict:
    """Every bank tree decoded on the held-out prompts, its decoded tau against the simulated tau
    on the same prompts. Greedy: outputs checked against AR. Under sampling (--temperature):
    the simulated tau is the rollout of the calibration's own sampled continuation (another draw
    from the same distribution); and the replay: the rollout of a calibration on the decoder's
    own output must take exactly the decoder's steps (a tree's drafts are one-hot, so a node is
    accepted iff the sampled token is its token: the steps are a function of the output)."""
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        bank_file = Path(tmp) / "bank.json"
        bank_file.write_text(json.dumps({"trees": [t.to_json() for t in bank], "schedules": {}}))  # static, index=i
        for i, tree in enumerate(tqdm(bank, desc="check", unit="tree")):
            drafter, target = subject.drafter(str(bank_file), i)
            tokens = calls = 0
            sim_cals, replay_cals, differ = [], [], []
            for j, (prompt, cal, cont) in enumerate(p for items in held.values() for p in items):
                got = decode(target, drafter, prompt["ids"], cal.n, **sampling(args, target.device, j, offset=10_000))
                if args.temperature:
                    replay_cals.append(subject.calibrate(prompt["ids"] + got.tokens, len(prompt["ids"]), cal.task))
                elif got.tokens != cont[: cal.n]:  # reported, not fatal: a GPU's low-precision ties may flip
                    differ.append(prompt["id"])
                    print(f"WARNING: tree {tree.name}: decoded output differs from AR on {prompt['id']}",
                          file=sys.stderr)
                tokens += len(got.tokens)
                calls += got.target_calls
                sim_cals.append(cal)
            sim = rollout(sim_cals, [tree], subject.k)
            decoded = tokens / calls
            row = {"tree": i, "name": tree.name, "nodes": tree.num_nodes, "decoded_tau": round(decoded, 4),
                   "sim_tau": round(sim.tau, 4), "error": round(sim.tau / decoded - 1, 4),
                   "differs_from_ar": differ}
            if args.temperature:
                replay = rollout(replay_cals, [tree], subject.k)
                row["replay_steps"], row["decoded_steps"] = round(replay.steps / replay.replicas, 2), calls
                if subject.chains_only:  # MTPC: the expected steps given the output, not its steps
                    row["replay_error"] = round(row["replay_steps"] / calls - 1, 4)
            rows.append(row)
    worst = max(abs(r["error"]) for r in rows)
    out = {"prompts": sum(len(v) for v in held.values()), "trees": rows, "max_abs_error": worst,
           "matches_ar": not any(r["differs_from_ar"] for r in rows)}
    if args.temperature and subject.chains_only:
        out["replay_max_abs_error"] = max(abs(r["replay_error"]) for r in rows)
    elif args.temperature:
        out["replay_exact"] = all(r["replay_steps"] == r["decoded_steps"] for r in rows)
    return out
