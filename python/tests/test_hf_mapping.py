"""The HF transformers recipes of docs/python.md: DynamicCache.crop, reorder_cache (beam search) and
batch_repeat_interleave as kvcache sequence operations, checked on the cells and on K rows."""
import numpy as np

from conftest import fill, small_cache


def k_rows(c, seq):
    """K rows of layer 0 of seq's cells, by position."""
    rows = {}
    for cell in range(c.size):
        pos, seqs = c.cell(0, cell)
        if seq in seqs:
            rows[pos] = c.read_k_row(0, 0, cell)
    return [rows[p] for p in sorted(rows)]


def test_crop():
    c = small_cache()
    fill(c, [1, 2, 3, 4, 5, 6])
    c.seq_rm(0, 4, -1)  # DynamicCache.crop(4)
    assert c.seq_pos_max(0) == 3 and c.used_cells() == 4
    fill(c, [9])  # decoding continues at position 4
    assert c.seq_pos_max(0) == 4


def test_batch_repeat_interleave_and_reorder():
    c = small_cache(n_seq_max=8)
    fill(c, [1, 2, 3])
    for beam in (1, 2, 3):  # batch_repeat_interleave(4): the prompt shared by 4 beams, no copy
        c.seq_cp(0, beam)
    assert c.used_cells() == 3
    for beam in range(4):
        fill(c, [10 + beam], seq=beam)
    # reorder_cache(beam_idx=[2, 2, 0, 3]): the new beam b continues old beam beam_idx[b]
    beam_idx = [2, 2, 0, 3]
    old = {b: k_rows(c, b) for b in range(4)}
    tmp = 4  # copy every source away first (a permutation may overwrite a source)
    for b, src in enumerate(beam_idx):
        c.seq_rm(tmp + b)
        c.seq_cp(src, tmp + b)
    for b in range(4):
        c.seq_rm(b)
        c.seq_cp(tmp + b, b)
        c.seq_rm(tmp + b)
    for b, src in enumerate(beam_idx):
        assert np.array_equal(np.array(k_rows(c, b)), np.array(old[src]))
    assert c.used_cells() == 3 + 3  # beam 1's token is gone: no beam continues it
