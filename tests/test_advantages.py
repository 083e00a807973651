"""Soft/hard attribution on hand-computed trees."""

import torch

from arpo_trl.advantages import hard_advantages, owner_mask, token_owners


def test_owners_follow_fork_positions():
    # 0: global, 6 tokens. 1: branch of 0 at 2 (5 tokens). 2: branch of 1 at 4 (6 tokens). 3: global, 3 tokens.
    owners = token_owners([0, 1, 2, 3], [None, 0, 1, None], [None, 2, 4, None], [6, 5, 6, 3], width=7)
    assert owners.tolist() == [
        [0, 0, 0, 0, 0, 0, -1],
        [0, 0, 1, 1, 1, -1, -1],
        [0, 0, 1, 1, 2, 2, -1],
        [3, 3, 3, -1, -1, -1, -1],
    ]
    assert owner_mask(owners, [0, 1, 2, 3]).tolist() == [
        [1, 1, 1, 1, 1, 1, 0],
        [0, 0, 1, 1, 1, 0, 0],
        [0, 0, 0, 0, 1, 1, 0],
        [1, 1, 1, 0, 0, 0, 0],
    ]


def test_hard_advantages_average_over_sharing_trajectories():
    owners = token_owners([0, 1, 2, 3], [None, 0, 1, None], [None, 2, 4, None], [6, 5, 6, 3], width=7)
    adv = torch.tensor([1.0, -1.0, 2.0, 0.5])
    out = hard_advantages(adv, owners, groups=[0, 0, 0, 0])
    shared_by_012 = (1.0 - 1.0 + 2.0) / 3  # tokens 0-1 of path 0
    shared_by_12 = (-1.0 + 2.0) / 2  # tokens 2-3 of path 1
    expected = torch.tensor([
        [shared_by_012, shared_by_012, 1.0, 1.0, 1.0, 1.0, 0.0],
        [shared_by_012, shared_by_012, shared_by_12, shared_by_12, -1.0, 0.0, 0.0],
        [shared_by_012, shared_by_012, shared_by_12, shared_by_12, 2.0, 2.0, 0.0],
        [0.5, 0.5, 0.5, 0.0, 0.0, 0.0, 0.0],
    ])
    torch.testing.assert_close(out, expected)


def test_groups_never_mix_and_global_paths_keep_their_own_advantage():
    owners = token_owners([0, 1, 5, 6], [None, 0, None, 5], [None, 1, None, 1], [2, 2, 2, 2], width=2)
    out = hard_advantages(torch.tensor([1.0, 3.0, -2.0, 0.0]), owners, groups=[0, 0, 1, 1])
    torch.testing.assert_close(out, torch.tensor([[2.0, 1.0], [2.0, 3.0], [-1.0, -2.0], [-1.0, 0.0]]))


def test_counted_once_hard_gradient_differs_from_soft():
    # With each shared token counted once at the mean, the summed weight of a shared token is mean, not Σ A.
    owners = token_owners([0, 1], [None, 0], [None, 2], [3, 3], width=3)
    adv = torch.tensor([1.0, -1.0])
    weights = hard_advantages(adv, owners, [0, 0]) * owner_mask(owners, [0, 1])
    assert weights.sum(0).tolist() == [0.0, 0.0, 0.0]
    assert weights[0].tolist() == [0.0, 0.0, 1.0] and weights[1].tolist() == [0.0, 0.0, -1.0]
