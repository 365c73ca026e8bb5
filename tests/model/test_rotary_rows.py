"""Meta's interleaved rotary rows read in HF's order: every chunking of a tensor, judged by the
permutation torchtitan's HF adapter applies (``view(heads, d/2, 2, cols).transpose(1, 2)``)."""

from __future__ import annotations

import pytest
import torch

from ckptctl.model.rotary_rows import RotaryRows, hf_runs, stored_rows


def _to_hf(stored: torch.Tensor, order: RotaryRows) -> torch.Tensor:
    """The whole tensor in HF row order, as torchtitan's adapter permutes q/k (per block, the
    rotary heads permuted, the rest kept)."""
    out = stored.clone()
    for block in range(0, stored.shape[0], order.period):
        heads = stored[block : block + order.rotary]
        d = order.head_dim
        out[block : block + order.rotary] = (
            heads.view(order.rotary // d, d // 2, 2, -1).transpose(1, 2).reshape(heads.shape)
        )
    return out


@pytest.mark.parametrize(
    "order",
    [RotaryRows(4, 4, 4), RotaryRows(8, 8, 8), RotaryRows(4, 16, 12)],  # q or k; fused QKV
)
@pytest.mark.parametrize("first", [0, 1, 3, 5, 8])
@pytest.mark.parametrize("count", [1, 2, 3, 7, 11, 27])
def test_a_chunk_reads_as_the_hf_rows_it_holds(order: RotaryRows, first: int, count: int) -> None:
    rows = 48
    if first + count > rows:
        pytest.skip("chunk past the tensor")
    stored = torch.arange(rows * 3, dtype=torch.float32).view(rows, 3)
    hf = _to_hf(stored, order)
    chunk = stored[first : first + count]
    local = chunk[stored_rows(order, first, count, 0, count)]
    # the chunk's local rows are HF rows, in order, as its runs say
    expected = torch.cat([hf[h : h + n] for _, h, n in hf_runs(order, first, count)])
    assert torch.equal(local, expected)
    assert sorted(int(r) for r in local[:, 0] // 3) == list(range(first, first + count))
    runs = hf_runs(order, first, count)
    assert [r[0] for r in runs] == [sum(n for _, _, n in runs[:i]) for i in range(len(runs))]
    # any part of the chunk reads alike
    for at in range(count):
        for n in range(1, count - at + 1):
            part = chunk[stored_rows(order, first, count, at, n)]
            assert torch.equal(part, local[at : at + n])


def test_a_chunk_of_whole_heads_is_one_run() -> None:
    assert hf_runs(RotaryRows(8, 8, 8), 16, 32) == [(0, 16, 32)]
