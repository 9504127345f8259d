"""Pearson chi-square goodness of fit for the sampling tests (scipy if present)."""

import math

import torch


def chi2_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson chi-square p-value of `counts` against `probs`; cells with expected count < 5 are
    pooled. A count on a zero-probability cell gives 0."""
    counts, probs = counts.flatten().double(), probs.flatten().double()
    if counts[probs == 0].sum() > 0:
        return 0.0
    expected = probs * counts.sum()
    order = expected.argsort()  # ascending
    small = int((expected < 5).sum())
    while 0 < small < len(order) and expected[order[:small]].sum() < 5:
        small += 1  # grow the pool of small cells until it reaches 5 too
    pooled, rest = order[:small], order[small:]
    obs = ([counts[pooled].sum().item()] if small else []) + counts[rest].tolist()
    exp = ([expected[pooled].sum().item()] if small else []) + expected[rest].tolist()
    stat = sum((o - e) ** 2 / e for o, e in zip(obs, exp))
    df = len(obs) - 1
    if df == 0:  # a single (pooled) cell: nothing left to compare
        return 1.0
    try:
        from scipy.stats import chi2
        return float(chi2.sf(stat, df))
    except ImportError:  # Wilson-Hilferty: the p = 0.001 critical value
        critical = df * (1 - 2 / (9 * df) + 3.0902 * math.sqrt(2 / (9 * df))) ** 3
        return 1.0 if stat <= critical else 0.0


def reference_probs(logits: torch.Tensor, temperature: float, top_p: float) -> torch.Tensor:
    """softmax(logits / T) [V] restricted to the top-p nucleus, written out here rather than taken
    from `target_probs` (which decoder and drafters share), so a wrong temperature or nucleus in
    the decoding path cannot hide in the tests' reference too."""
    probs = torch.softmax(logits.double() / temperature, -1)
    if top_p < 1.0:
        order = probs.argsort(descending=True)
        sorted_probs = probs[order]
        kept = order[sorted_probs.cumsum(0) - sorted_probs < top_p]
        probs = torch.zeros_like(probs).index_copy(0, kept, probs[kept])
        probs = probs / probs.sum()
    return probs
