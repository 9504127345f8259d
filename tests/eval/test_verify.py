"""The verifier's pure functions: tree attention layout and the two acceptance rules.

The sampling rule is checked statistically: the tokens it emits must be distributed exactly as
the target's, and the same check must reject a deliberately wrong rule (so it has power).
"""

from functools import lru_cache

import pytest
import torch

from chisquare import chi2_pvalue
from mtpkit.models.decoding.verify import attention_inputs, verify_greedy, verify_sampling
from mtpkit.models.trees import children_of, tree_layout

PARENT_LISTS = {
    "chain": (-1, 0, 1, 2, 3),
    "star": (-1, 0, 0, 0, 0),
    "mixed-depth-3": (-1, 0, 0, 1, 1, 2, 3, 5, 0),
    "context-then-tree": (-1, 0, 1, 2, 3, 3, 4, 5, 5, 6, 8),  # 4 context tokens, root = node 3
}


# --------------------------------------------------------------------------- layout

def _ancestors_or_self(parents, i):
    """Brute force: walk the parent links up from node i."""
    seen = [i]
    while parents[seen[-1]] >= 0:
        seen.append(parents[seen[-1]])
    return seen


@pytest.mark.parametrize("parents", PARENT_LISTS.values(), ids=PARENT_LISTS.keys())
def test_tree_layout_matches_brute_force(parents):
    """The mask lets each node see exactly its ancestors and itself; depth = number of ancestors."""
    allowed, depth = tree_layout(parents)
    Q = len(parents)
    expected = torch.zeros(Q, Q, dtype=torch.bool)
    for i in range(Q):
        expected[i, _ancestors_or_self(parents, i)] = True
    assert torch.equal(allowed, expected)
    assert depth.tolist() == [len(_ancestors_or_self(parents, i)) - 1 for i in range(Q)]


@pytest.mark.parametrize("cache_len", [0, 5])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("parents", PARENT_LISTS.values(), ids=PARENT_LISTS.keys())
def test_attention_inputs_mask_and_positions(parents, dtype, cache_len):
    """Cached columns are all visible; tree columns are visible only for ancestor-or-self pairs
    (finfo.min elsewhere); a node's position is the cache length plus its depth."""
    mask, position_ids = attention_inputs(parents, cache_len, dtype)
    Q = len(parents)
    assert mask.shape == (1, 1, Q, cache_len + Q) and mask.dtype == dtype
    assert position_ids.shape == (1, Q)
    for i in range(Q):
        visible = set(_ancestors_or_self(parents, i))
        for j in range(cache_len + Q):
            want = 0.0 if j < cache_len or (j - cache_len) in visible else torch.finfo(dtype).min
            assert mask[0, 0, i, j].item() == want, (i, j)
        assert position_ids[0, i].item() == cache_len + len(visible) - 1


@pytest.mark.parametrize("parents", [(-1, 1), (-1, 0, 3, 0), (-1, 0, 2)])
def test_parent_not_before_child_raises(parents):
    """A parent index >= the node's own index is refused."""
    with pytest.raises(ValueError):
        tree_layout(parents)


def test_children_of_lists_children_in_order():
    """Draft parents (0 = root) become per-node child lists, root included."""
    assert children_of(torch.tensor([0, 0, 1, 2, 2]), 6) == [[1, 2], [3], [4, 5], [], [], []]


# --------------------------------------------------------------------------- greedy

# step tree: root 0 -> {1: token 3, 2: token 5}; 1 -> {3: token 2}; 2 -> {4: token 6, 5: token 1};
# 5 -> {6: token 7}
GREEDY_TOKENS = [0, 3, 5, 2, 6, 1, 7]
GREEDY_CHILDREN = children_of(torch.tensor([0, 0, 1, 2, 2, 5]), 7)


def _logits_with_argmax(argmax: dict[int, int], V: int = 8):
    """logits(node) peaked on argmax[node] (small noise elsewhere)."""
    g = torch.Generator().manual_seed(0)
    table = {n: torch.rand(V, generator=g) for n in range(len(GREEDY_TOKENS))}
    for n, t in argmax.items():
        table[n][t] = 5.0
    return lambda n: table[n]


@pytest.mark.parametrize("argmax, path, last, bonus", [
    ({0: 5, 2: 1, 5: 7, 6: 4}, [2, 5, 6], 6, 4),  # second sibling, then the matching sibling, to a leaf
    ({0: 5, 2: 1, 5: 3}, [2, 5], 5, 3),            # stops when no child holds the argmax
    ({0: 3, 1: 2, 3: 0}, [1, 3], 3, 0),            # first sibling branch
    ({0: 4}, [], 0, 4),                            # nothing accepted: the bonus is the root's argmax
])
def test_verify_greedy_takes_the_longest_argmax_path(argmax, path, last, bonus):
    """The accepted path follows the child holding the target's argmax at each node; the bonus is
    the argmax at the last accepted node."""
    assert verify_greedy(_logits_with_argmax(argmax), GREEDY_CHILDREN, GREEDY_TOKENS) == (path, last, bonus)


# --------------------------------------------------------------------------- sampling (statistics)

V = 6
DRAWS = 10000        # pure torch, ~0.4 ms per verify call
WRONG_DRAWS = 3000   # the wrong rule is caught even with fewer draws
# step tree: root 0 -> {1, 2 (drawn i.i.d. from Q1), 3 (deterministic)}; 1 -> {4 (drawn from
# Q2[token of 1])}; 2 -> {}; 3 -> {5 (deterministic)}. Parents are the draft parents (0 = root).
TREE_PARENTS = torch.tensor([0, 0, 0, 1, 3])
CHILDREN = children_of(TREE_PARENTS, 6)
DETERMINISTIC_TOKENS = [0, 2, 4, 1, 3, 2]  # root's token unused


def _distributions():
    """Fixed target (P1 after the root, P2[x] after token x, P3 deeper) and draft (Q1, Q2[x])
    distributions, drawn independently of each other so rejections are frequent."""
    g = torch.Generator().manual_seed(1234)
    soft = lambda *shape: torch.softmax(1.5 * torch.randn(*shape, generator=g), -1)
    return soft(V), soft(V, V), soft(V), soft(V), soft(V, V)


P1, P2, P3, Q1, Q2 = _distributions()


def _verify_sampling_without_residual(probs, children, tokens, draft_probs, generator=None):
    """A WRONG rule: accepts with min(1, p/q) but never moves p to the residual max(p - q, 0), so
    later siblings and the bonus are drawn from the unmodified target."""
    node, path = 0, []
    while True:
        p = probs(node)
        for child in children[node]:
            x = tokens[child]
            q = torch.nn.functional.one_hot(torch.tensor(x), V).float() if draft_probs is None else draft_probs[child - 1]
            if q[x] > 0 and torch.rand((), generator=generator) < torch.clamp(p[x] / q[x], max=1.0):
                path.append(child)
                node = child
                break
        else:
            return path, node, int(torch.multinomial(p, 1, generator=generator))


def _draw_trees(deterministic: bool, n: int, g: torch.Generator):
    """Per trial: the step tokens (root first) and draft_probs. Sampled drafts are redrawn every
    trial: nodes 1, 2 i.i.d. from Q1, node 4 from Q2[token of node 1]; nodes 3 and 5 are fixed
    (one-hot rows)."""
    if deterministic:
        return [(DETERMINISTIC_TOKENS, None)] * n
    first = torch.multinomial(Q1, 2 * n, replacement=True, generator=g).view(n, 2)
    below = torch.multinomial(Q2, n, replacement=True, generator=g)  # [V, n]: a draw after each token
    one_hot = torch.nn.functional.one_hot(torch.tensor(DETERMINISTIC_TOKENS), V).float()
    trials = []
    for i in range(n):
        x1, x2 = first[i].tolist()
        x4 = int(below[x1, i])
        tokens = [0, x1, x2, DETERMINISTIC_TOKENS[3], x4, DETERMINISTIC_TOKENS[5]]
        draft_probs = torch.stack([Q1, Q1, one_hot[3], Q2[x1], one_hot[5]])
        trials.append((tokens, draft_probs))
    return trials


@lru_cache(maxsize=None)  # the one-token and two-token checks share their draws
def _emitted(verify_fn, deterministic: bool, n: int, seed: int) -> torch.Tensor:
    """[n, 2] first two tokens emitted per trial: accepted draft tokens then the bonus; when only
    the bonus x1 was emitted, x2 is what the next target step draws, from P2[x1]."""
    g = torch.Generator().manual_seed(seed)
    next_step = torch.multinomial(P2, n, replacement=True, generator=g)  # [V, n]
    out = torch.empty(n, 2, dtype=torch.long)
    for i, (tokens, draft_probs) in enumerate(_draw_trees(deterministic, n, g)):
        probs = lambda node: P1 if node == 0 else P2[tokens[node]] if node <= 3 else P3  # 4, 5: depth 2
        path, _, bonus = verify_fn(probs, CHILDREN, tokens, draft_probs, g)
        emitted = [tokens[node] for node in path] + [bonus]
        out[i, 0] = emitted[0]
        out[i, 1] = emitted[1] if len(emitted) > 1 else next_step[emitted[0], i]
    return out


def _first_token_matches(verify_fn, deterministic: bool, joint: bool = False, n: int = DRAWS,
                         seed: int = 0) -> bool:
    """True if the first emitted token (with `joint`, the first two) passes a chi-square test at
    p = 0.001 against the target distribution AND is within a small total variation of it."""
    emitted = _emitted(verify_fn, deterministic, n, seed)
    if joint:
        counts = torch.bincount(emitted[:, 0] * V + emitted[:, 1], minlength=V * V).view(V, V)
        target, tv_bound = P1[:, None] * P2, 0.04
    else:
        counts, target, tv_bound = torch.bincount(emitted[:, 0], minlength=V), P1, 0.025
    tv = 0.5 * (counts.double() / n - target.double()).abs().sum().item()
    return chi2_pvalue(counts, target) > 1e-3 and tv < tv_bound


@pytest.mark.parametrize("deterministic", [False, True], ids=["sampled-drafts", "deterministic-drafts"])
def test_verify_sampling_first_token_is_target_distributed(deterministic):
    """Recursive rejection sampling over siblings emits a first token distributed as P1."""
    assert _first_token_matches(verify_sampling, deterministic), "first emitted token is not distributed as the target"


def test_verify_sampling_first_two_tokens_are_target_distributed():
    """Two levels: accepted tokens then the bonus follow the target joint P1(x1) P2(x2 | x1)."""
    assert _first_token_matches(verify_sampling, deterministic=False, joint=True), \
        "first two emitted tokens are not distributed as the target joint"


@pytest.mark.parametrize("deterministic", [False, True], ids=["sampled-drafts", "deterministic-drafts"])
def test_the_statistic_rejects_a_wrong_rule(deterministic):
    """The same check flags a rule that skips the residual update: the test has power."""
    assert not _first_token_matches(_verify_sampling_without_residual, deterministic, n=WRONG_DRAWS), \
        "the statistic fails to flag a sampling rule without the residual update"


def test_chi2_pvalue_sanity():
    """The helper itself: exact counts pass, skewed counts and impossible outcomes fail."""
    probs = torch.tensor([0.5, 0.3, 0.2, 0.0])
    assert chi2_pvalue(torch.tensor([500, 300, 200, 0]), probs) > 0.99
    assert chi2_pvalue(torch.tensor([600, 250, 150, 0]), probs) < 1e-3
    assert chi2_pvalue(torch.tensor([500, 300, 199, 1]), probs) == 0.0


def test_acceptance_on_the_device_accepts_what_the_host_walk_accepts():
    """Random chains and trees (extra nodes after the drafts, a 2-token vocabulary so siblings
    share tokens): the device accepts the host walk's path node for node (of siblings holding one
    token, the first), and it is a path of the target's argmaxes."""
    import random

    from mtpkit.models.decoding.verify import accept_on_device, path_to, walk_greedy
    from mtpkit.models.trees import children_of, tree_layout

    rng = random.Random(0)
    for _ in range(2000):
        N = rng.randint(0, 12)
        chain = rng.random() < 0.3
        parents = [j - 1 if chain else rng.randint(0, j - 1) for j in range(1, N + 1)]
        tokens = [rng.randrange(2) for _ in range(N + 1)]
        argmaxes = [rng.randrange(2) for _ in range(N + 3)]
        layout = None if chain else tree_layout(tuple([-1] + parents + [rng.randint(0, N) for _ in range(2)]))
        got = path_to(int(accept_on_device(torch.tensor(argmaxes), torch.tensor(tokens), layout)), parents)
        walked, _, _ = walk_greedy(argmaxes.__getitem__, children_of(parents, 1 + N), tokens)
        assert all(tokens[b] == argmaxes[a] for a, b in zip([0] + got, got)), (parents, tokens, argmaxes, got)
        assert got == walked, (parents, tokens, argmaxes, got, walked)
