"""Benchmark the circuit heads alone: native tensor code vs the same circuits through cirkit.

    python eval/bench_heads.py --batch 64 -n 16 --rank 32 --vocab 320 --out runs/bench_heads.json

For each structure (FF, CP, HMM, BTree), with random per-example parameters of B windows:
- `loglik_fwd_bwd`: log q(x) of B windows, forward + backward into the parameters;
- `sample`: one window per example (B x n tokens), ancestral, top-down;
- `prefix_marginals`: q(x_1..i) for every i of B windows (Algorithm 3, line 9).
Times are medians over --repeats after a warm-up, in milliseconds, both implementations in the
same process, interleaved; the table also gives cirkit / native.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from mtpkit.models.atomic_write import write_atomic
from mtpkit.models.process import run_script
from mtpkit.models.mtpc.circuit_cirkit import CirkitCircuit
from mtpkit.models.mtpc.circuits import ARCHS, CircuitParams, log_prob, num_inner, prefix_log_probs, sample


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=64, help="windows (examples) per call")
    p.add_argument("-n", "--window", dest="n", type=int, default=16, help="window length n")
    p.add_argument("--rank", type=int, default=32, help="circuit rank r")
    p.add_argument("--vocab", type=int, default=320, help="vocabulary size V (EvaByte: 320)")
    p.add_argument("--archs", nargs="+", default=list(ARCHS), choices=ARCHS, help="structures to measure")
    p.add_argument("--repeats", type=int, default=5, help="timed calls per measurement (median)")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0 = default)")
    p.add_argument("--out", help="write the results as JSON here")
    return p.parse_args(argv)


def random_params(arch: str, B: int, n: int, r: int, V: int, grad: bool) -> CircuitParams:
    g = torch.Generator().manual_seed(0)
    r = 1 if arch == "ff" else r
    leaf = lambda t: t.requires_grad_(grad)  # noqa: E731
    log_phi = leaf(torch.randn(B, n, r, V, generator=g).log_softmax(-1))
    root = leaf(torch.randn(B, r, generator=g).softmax(-1)) if arch != "ff" else None
    L = num_inner(arch, n)
    inner = leaf(torch.randn(B, L, r, r, generator=g).softmax(-1)) if L else None
    return CircuitParams(arch, log_phi, root, inner)


def median_ms(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    B, n, r, V = args.batch, args.n, args.rank, args.vocab
    x = torch.randint(0, V, (B, n), generator=torch.Generator().manual_seed(1))
    rows = []
    for arch in args.archs:
        circuit = CirkitCircuit(arch, n, r, V)
        p_grad = random_params(arch, B, n, r, V, grad=True)
        p = random_params(arch, B, n, r, V, grad=False)
        assert torch.allclose(circuit.log_prob(p, x), log_prob(p, x), atol=1e-4), arch  # same circuits

        def fwd_bwd(ll):
            def run():
                ll(p_grad).sum().backward()
            return run

        tasks = {
            "loglik_fwd_bwd": (fwd_bwd(lambda q: log_prob(q, x)), fwd_bwd(lambda q: circuit.log_prob(q, x))),
            "sample": (lambda: sample(p), lambda: circuit.sample(p, 1)),
            "prefix_marginals": (lambda: prefix_log_probs(p, x), lambda: circuit.prefix_log_probs(p, x)),
        }
        for task, (native, cirkit) in tasks.items():
            with torch.set_grad_enabled(task == "loglik_fwd_bwd"):
                t_native = median_ms(native, args.repeats)
                t_cirkit = median_ms(cirkit, args.repeats)
            rows.append({"arch": arch, "task": task, "native_ms": t_native, "cirkit_ms": t_cirkit,
                         "cirkit_over_native": t_cirkit / t_native})
            print(f"{arch:6s} {task:17s} native {t_native:8.2f} ms   cirkit {t_cirkit:8.2f} ms   "
                  f"cirkit/native {t_cirkit / t_native:5.1f}x", flush=True)
    result = {"config": {"batch": B, "n": n, "r": r, "V": V, "repeats": args.repeats,
                         "threads": torch.get_num_threads()}, "rows": rows}
    table = ["| arch | task | native ms | cirkit ms | cirkit / native |", "|---|---|---|---|---|"]
    table += [f"| {r_['arch']} | {r_['task']} | {r_['native_ms']:.2f} | {r_['cirkit_ms']:.2f} | "
              f"{r_['cirkit_over_native']:.1f}x |" for r_ in rows]
    print("\n".join(table))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        write_atomic(args.out, json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    run_script(main)
