"""State to and from bytes, session files, llama.cpp sequence files: round trips and refusals that leave
the memory as it was."""
import os

import numpy as np
import pytest

import kvcache
from conftest import fill, small_cache


def snapshot(c):
    return [(c.seq_pos_min(s), c.seq_pos_max(s)) for s in range(c.n_seq_max)], c.used_cells(), c.state_get()


def test_state_bytes_round_trip():
    a = small_cache()
    fill(a, [1, 2, 3, 4], seq=0)
    fill(a, [5, 6], seq=2)
    whole = a.state_get()
    assert isinstance(whole, bytes) and len(whole) == a.state_size()
    assert len(whole) - 8 <= a.state_max_bytes < 1 << 30  # the most a load accepts
    b = small_cache(kv_size=128)  # another capacity: same layout
    assert b.state_set(whole) == len(whole)
    assert [b.seq_pos_max(s) for s in range(4)] == [3, -1, 1, -1]
    assert np.array_equal(b.read_k_row(1, 0, 3), a.read_k_row(1, 0, 3))
    one = a.state_get(seq_id=2)
    b.state_set(one, dest=3)
    assert b.seq_pos_max(3) == 1 and b.used_cells() == 8


def test_bad_state_raises_and_changes_nothing():
    a = small_cache()
    fill(a, [1, 2, 3])
    data = a.state_get(seq_id=0)
    b = small_cache()
    fill(b, [9, 9], seq=1)
    before = snapshot(b)
    with pytest.raises(kvcache.CorruptDataError) as e:
        b.state_set(data[:-5], dest=0)  # truncated
    assert e.value.status == "corrupt_data"
    with pytest.raises(kvcache.Error):
        b.state_set(data + b"\0", dest=0)  # trailing byte
    other = small_cache(type_k="f16")
    with pytest.raises(kvcache.Error):
        other.state_set(data, dest=0)
    assert snapshot(b) == before
    assert other.used_cells() == 0


def test_session_file(tmp):
    a = small_cache()
    fill(a, [1, 2, 3, 4, 5])
    path = os.path.join(tmp, "s.kvc")
    size = a.save_file(path, seq_id=0, tokens=[1, 2, 3, 4, 5], compress=True)
    assert size == os.path.getsize(path)
    assert kvcache.read_session_header(path) == {"format": "kvcache", "version": 1, "n_tokens": 5}
    b = small_cache()
    info = b.load_file(path, dest=1)
    assert info.seq_id == 0 and info.tokens.tolist() == [1, 2, 3, 4, 5] and info.layout == a.layout
    assert b.seq_pos_max(1) == 4
    with pytest.raises(kvcache.OutOfRangeError):
        b.load_file(path, dest=2, max_tokens=3)
    # a damaged byte: the checksum refuses it, nothing changes
    with open(path, "r+b") as f:
        f.seek(100)
        byte = f.read(1)
        f.seek(100)
        f.write(bytes([byte[0] ^ 1]))
    before = snapshot(b)
    with pytest.raises(kvcache.CorruptDataError):
        b.load_file(path, dest=2)
    assert snapshot(b) == before
    with pytest.raises(kvcache.IOError) as e:
        b.load_file(os.path.join(tmp, "missing.kvc"))
    assert isinstance(e.value, OSError) and "missing.kvc" in str(e.value)


def test_llama_seq_file(tmp):
    a = small_cache()
    fill(a, [7, 8, 9])
    path = os.path.join(tmp, "s.ggsq")
    a.save_llama_seq_file(path, 0, [7, 8, 9])
    b = small_cache()
    assert b.load_llama_seq_file(path, 3).tolist() == [7, 8, 9]
    assert b.seq_pos_max(3) == 2
