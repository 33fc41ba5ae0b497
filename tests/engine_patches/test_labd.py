"""LABD fusion logic (pure tensors, CPU): which positions take the lookup, and q stays exact."""
from __future__ import annotations

import pytest
import torch

from backend.plugin.labd import fuse_lookup_drafts, point_mass_

pytestmark = pytest.mark.unit

DRAFT = torch.tensor([[1, 2, 3, 4], [5, 6, 7, 8], [9, 9, 9, 9]])
LOOKUP = torch.tensor([[1, 2, 30, 40], [50, 60, 70, 80], [0, 0, 0, 0]])


def test_strong_match_wins_up_to_its_length() -> None:
    tokens, mask = fuse_lookup_drafts(DRAFT, LOOKUP, torch.tensor([4, 2, 0]))
    assert tokens.tolist() == [[1, 2, 30, 40], [50, 60, 7, 8], [9, 9, 9, 9]]
    assert mask.tolist() == [[True] * 4, [True, True, False, False], [False] * 4]


def test_agree_requires_the_drafter_to_start_the_same() -> None:
    tokens, mask = fuse_lookup_drafts(DRAFT, LOOKUP, torch.tensor([4, 4, 0]), agree=2)
    assert tokens.tolist() == [[1, 2, 30, 40], [5, 6, 7, 8], [9, 9, 9, 9]]
    assert mask[1].tolist() == [False] * 4


def test_bad_shapes_are_refused() -> None:
    with pytest.raises(ValueError, match=r"must both be \[B, k\]"):
        fuse_lookup_drafts(DRAFT, LOOKUP[:, :3], torch.tensor([1, 1, 1]))
    with pytest.raises(ValueError, match="agree must be in"):
        fuse_lookup_drafts(DRAFT, LOOKUP, torch.tensor([1, 1, 1]), agree=5)


def test_point_mass_keeps_rejection_sampling_exact() -> None:
    torch.manual_seed(0)
    logits = torch.randn(5, 4, 100)  # 5 request-state rows, k=4, V=100
    before = logits.clone()
    rows = torch.tensor([3, 0, 2])
    tokens, mask = fuse_lookup_drafts(DRAFT, LOOKUP, torch.tensor([4, 2, 0]))
    point_mass_(logits, rows, tokens, mask)
    q = torch.softmax(logits / 0.7, dim=-1)  # any temperature: still one-hot
    assert torch.equal(q[3, 2], torch.nn.functional.one_hot(torch.tensor(30), 100).float())
    assert torch.equal(q[0, 1], torch.nn.functional.one_hot(torch.tensor(60), 100).float())
    assert torch.equal(logits[0, 2:], before[0, 2:])  # drafter positions untouched
    assert torch.equal(logits[2], before[2]) and torch.equal(logits[[1, 4]], before[[1, 4]])
