from types import SimpleNamespace

import torch

from mtpkit.eval.report import explain_mismatch, first_difference


class FixedLogits:
    """A stand-in target whose next-token logits are fixed: [V] for every prefix."""

    def __init__(self, row):
        self.row = torch.tensor(row)

    def __call__(self, input_ids):
        return SimpleNamespace(logits=self.row.expand(1, input_ids.shape[1], -1))


def test_first_difference():
    assert first_difference([1, 2, 3], [1, 2, 3]) is None
    assert first_difference([1, 2, 3], [1, 5, 3]) == 1
    assert first_difference([1, 2], [1, 2, 3]) == 2


def test_mismatch_at_a_near_tie_is_recognised_and_counted():
    tie = explain_mismatch(FixedLogits([0.0, 3.0, 3.0 - 5e-5, 1.0]), [7, 8], [1, 1, 2], [1, 1, 1])
    assert tie["position"] == 2 and tie["near_tie"] and tie["top2_gap"] < 1e-4


def test_mismatch_without_a_tie_is_not_excused():
    real = explain_mismatch(FixedLogits([0.0, 3.0, 2.0, 1.0]), [7, 8], [1, 1, 2], [1, 1, 1])
    assert not real["near_tie"] and abs(real["top2_gap"] - 1.0) < 1e-6
