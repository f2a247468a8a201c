"""Sequence packing: rows cover every token once, labels and attention never cross a document boundary."""

import pytest
import torch
from torch.nn import functional

from d9d.core.data import (
    IGNORE_INDEX,
    Segment,
    SplitPackingPlan,
    block_causal_mask,
    pack_documents,
    plan_packing,
)


def _documents(lengths):
    return [torch.arange(100 * (number + 1), 100 * (number + 1) + length) for number, length in enumerate(lengths)]


@pytest.mark.parametrize("mode", ["split", "whole"])
def test_every_token_lands_in_exactly_one_row(mode):
    lengths = [5, 0, 9, 3, 12, 1, 7]
    rows = plan_packing(lengths, 8, mode=mode)
    covered = sorted((s.document, t) for row in rows for s in row for t in range(s.start, s.stop))
    assert covered == [(d, t) for d, length in enumerate(lengths) for t in range(length)]
    assert all(sum(s.length for s in row) <= 8 for row in rows)


def test_split_mode_fills_rows_and_whole_mode_keeps_documents_together():
    lengths = [5, 6, 3]
    assert plan_packing(lengths, 8, mode="split") == [
        (Segment(0, 0, 5), Segment(1, 0, 3)),
        (Segment(1, 3, 6), Segment(2, 0, 3)),
    ]
    assert plan_packing(lengths, 8, mode="whole") == [(Segment(0, 0, 5),), (Segment(1, 0, 6),), (Segment(2, 0, 3),)]
    assert plan_packing([3, 20], 8, mode="whole") == [
        (Segment(0, 0, 3),),
        (Segment(1, 0, 8),),
        (Segment(1, 8, 16),),
        (Segment(1, 16, 20),),
    ]


def test_the_lazy_split_plan_equals_the_eager_one():
    lengths = torch.randint(0, 30, (200,), generator=torch.Generator().manual_seed(0)).tolist()
    lazy = SplitPackingPlan(lengths, 16)
    assert [lazy[row] for row in range(len(lazy))] == plan_packing(lengths, 16, mode="split")


def test_a_row_carries_positions_documents_and_boundary_safe_labels():
    (row, last) = pack_documents(_documents([3, 4, 2]), 6)
    assert row.input_ids.tolist() == [100, 101, 102, 200, 201, 202]
    assert row.position_ids.tolist() == [0, 1, 2, 0, 1, 2]
    assert row.document_ids.tolist() == [0, 0, 0, 1, 1, 1]
    assert row.labels.tolist() == [101, 102, IGNORE_INDEX, 201, 202, IGNORE_INDEX]
    assert row.cu_seqlens().tolist() == [0, 3, 6]
    assert last.input_ids.tolist() == [203, 300, 301, 0, 0, 0]
    assert last.position_ids.tolist()[:3] == [3, 0, 1], "a continued document keeps counting its positions"
    assert last.document_ids.tolist() == [1, 2, 2, -1, -1, -1]
    assert last.labels.tolist() == [IGNORE_INDEX, 301, IGNORE_INDEX, IGNORE_INDEX, IGNORE_INDEX, IGNORE_INDEX]
    assert last.cu_seqlens().tolist() == [0, 1, 3]


def test_the_mask_makes_packed_attention_equal_separate_attention():
    documents = _documents([3, 5])
    (row,) = pack_documents(documents, 10)
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, 10, 4) for _ in range(3))
    mask = row.attention_mask()
    assert mask.shape == (10, 10) and not mask[8:].any() and not mask[:, 8:].any()
    packed = functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    for start, stop in [(0, 3), (3, 8)]:
        alone = functional.scaled_dot_product_attention(
            q[..., start:stop, :], k[..., start:stop, :], v[..., start:stop, :], is_causal=True
        )
        torch.testing.assert_close(packed[..., start:stop, :], alone)


def test_the_mask_batches():
    ids = torch.tensor([[0, 0, 1, -1], [2, 2, 2, 2]])
    mask = block_causal_mask(ids)
    assert mask.shape == (2, 4, 4)
    assert mask[0].tolist() == [
        [True, False, False, False],
        [True, True, False, False],
        [False, False, True, False],
        [False, False, False, False],
    ]
    assert torch.equal(mask[1], torch.ones(4, 4, dtype=torch.bool).tril())
