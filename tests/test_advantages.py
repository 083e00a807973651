"""Soft/hard attribution on hand-computed trees."""

import torch

from arpo_trl.training.advantages import hard_advantages, owner_mask, token_owners, trained_mask


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
    # Each group numbers its paths from 0, so the same node ids (0 global, 1 its branch) appear in both groups:
    # an implementation that ignored `groups` would average each shared column over all four rows.
    per_group = token_owners([0, 1], [None, 0], [None, 1], [2, 2], width=2)
    owners = torch.cat([per_group, per_group])
    out = hard_advantages(torch.tensor([1.0, 3.0, -2.0, 0.0]), owners, groups=[0, 0, 1, 1])
    torch.testing.assert_close(out, torch.tensor([[2.0, 1.0], [2.0, 3.0], [-1.0, -2.0], [-1.0, 0.0]]))


def test_counted_once_hard_gradient_differs_from_soft():
    # Path 1 branches off path 0 at 2 and shares its first two tokens. With advantages 1 and 3 a shared token gets
    # their mean, 2, and is trained once (in path 0's row); soft attribution trains it in both rows, so its summed
    # weight is Σ A = 4, as is that of hard advantages counted in every row (owner mask ignored).
    owners = token_owners([0, 1], [None, 0], [None, 2], [3, 3], width=3)
    adv = torch.tensor([1.0, 3.0])
    hard = hard_advantages(adv, owners, [0, 0])
    mask = owner_mask(owners, [0, 1])
    assert mask.tolist() == [[1, 1, 1], [0, 0, 1]]
    weights = hard * mask
    assert weights.tolist() == [[2.0, 2.0, 1.0], [0.0, 0.0, 3.0]]
    assert weights.sum(0).tolist() == [2.0, 2.0, 4.0]  # shared columns: the mean, once
    soft = adv[:, None].expand(2, 3)
    assert soft.sum(0).tolist() == [4.0, 4.0, 4.0] == hard.sum(0).tolist()  # Σ A: what counting once avoids


def test_owners_are_exact_integer_path_ids():
    # Path ids are compared with the trainer's trajectory ids; a float tensor would merge ids past 2**24.
    big = 2**24 + 1
    ids = [big, big + 2]
    owners = token_owners(ids, [None, big], [None, 1], [2, 3], width=3)
    assert owners.dtype == torch.long
    assert owners.tolist() == [[big, big, -1], [big, big + 2, big + 2]]
    assert owner_mask(owners, ids).tolist() == [[1, 1, 0], [0, 1, 1]]


def test_hard_advantages_keep_the_advantages_dtype_and_device():
    """The trainer's advantages live on its accelerator, in its dtype: the per-token advantages come back alike. The
    'meta' device stands in for a GPU here (a tensor on another device than the advantages' would raise)."""
    owners = token_owners([0, 1], [None, 0], [None, 1], [2, 2], width=2)
    tiny = 2.0**-40  # lost next to 1.0 in float32
    adv = torch.tensor([1.0, 1.0 + 2 * tiny], dtype=torch.float64)
    expected = torch.tensor([[1.0 + tiny, 1.0], [1.0 + tiny, 1.0 + 2 * tiny]], dtype=torch.float64)
    torch.testing.assert_close(hard_advantages(adv, owners, [0, 0]), expected, rtol=0, atol=0)
    on_meta = hard_advantages(adv.to("meta"), owners, [0, 0])
    assert on_meta.device.type == "meta" and on_meta.shape == (2, 2) and on_meta.dtype == torch.float64


def test_tokens_of_a_dropped_row_are_trained_once_in_a_kept_row_sharing_them():
    # The tree of test_owners_follow_fork_positions. TRL drops rows 0 and 1 (truncated, mask_truncated_completions):
    # path 0's tokens 0-1 are shared by 1 and 2, so row 2 trains them; path 0's tokens 2-5 and path 1's token 4 are
    # nobody else's and are trained nowhere; path 1's tokens 2-3 go to row 2 too.
    owners = token_owners([0, 1, 2, 3], [None, 0, 1, None], [None, 2, 4, None], [6, 5, 6, 3], width=7)
    assert trained_mask(owners, [0, 1, 2, 3], kept=[True] * 4).tolist() == owner_mask(owners, [0, 1, 2, 3]).tolist()
    assert trained_mask(owners, [0, 1, 2, 3], kept=[False, False, True, True]).tolist() == [
        [0, 0, 0, 0, 0, 0, 0],
        [0, 0, 0, 0, 0, 0, 0],
        [1, 1, 1, 1, 1, 1, 0],
        [1, 1, 1, 0, 0, 0, 0],
    ]
    # Only row 0 dropped: its shared tokens go to the first kept row sharing them (row 1), each exactly once.
    mask = trained_mask(owners, [0, 1, 2, 3], kept=[False, True, True, True])
    assert mask.tolist()[:3] == [[0, 0, 0, 0, 0, 0, 0], [1, 1, 1, 1, 1, 0, 0], [0, 0, 0, 0, 1, 1, 0]]


def test_hard_advantages_average_over_the_kept_rows_sharing_a_token():
    owners = token_owners([0, 1, 2, 3], [None, 0, 1, None], [None, 2, 4, None], [6, 5, 6, 3], width=7)
    adv = torch.tensor([1.0, -1.0, 2.0, 0.5])
    out = hard_advantages(adv, owners, groups=[0, 0, 0, 0], kept=torch.tensor([False, True, True, True]))
    shared_by_12 = (-1.0 + 2.0) / 2  # tokens 0-3: row 0, which also holds tokens 0-1, is out of the loss
    assert out[1].tolist() == [shared_by_12] * 4 + [-1.0, 0.0, 0.0]
    assert out[2].tolist() == [shared_by_12] * 4 + [2.0, 2.0, 0.0]
    assert out[3].tolist() == [0.5, 0.5, 0.5, 0.0, 0.0, 0.0, 0.0]
