"""A pure-numpy attention model decoding through kvcache, checked against recomputation without the cache.

Tiny random weights (2 layers, 4 query heads over 2 KV heads of 8 values, llama RoPE). Per ubatch the
model computes K/V of its tokens, writes them into the cache (cpy_k / cpy_v), and attends over the cache's
zero-copy K/V views with its KQ mask. The reference runs the same model without kvcache: each sequence's keys
and values in plain lists, attention recomputed from them token by token. Steps: two prompts in one batch, generation, a prefix-cache hit (a third sequence starts
with the cells of a cached prompt and decodes only its tail), and a context shift (seq_rm + seq_add: the
cache re-rotates the shifted keys). Exit status 0 when every step's logits agree.
"""
import sys

import numpy as np

import kvcache

N_LAYER, N_HEAD, N_HEAD_KV, HEAD, N_VOCAB = 2, 4, 2, 8, 64
N_EMBD = N_HEAD * HEAD
rng = np.random.default_rng(20)
W = {name: rng.standard_normal(shape).astype(np.float32) * 0.3 for name, shape in [
    ("emb", (N_VOCAB, N_EMBD)), ("out", (N_EMBD, N_VOCAB)), ("q", (N_LAYER, N_EMBD, N_HEAD * HEAD)),
    ("k", (N_LAYER, N_EMBD, N_HEAD_KV * HEAD)), ("v", (N_LAYER, N_EMBD, N_HEAD_KV * HEAD)),
    ("o", (N_LAYER, N_HEAD * HEAD, N_EMBD))]}


def rope(x, pos):
    """llama ('normal') RoPE over whole heads: pairs (x[2i], x[2i+1]) turn by pos * 10000^(-2i/HEAD)."""
    theta = pos[:, None] * 10000.0 ** (-np.arange(0, HEAD, 2) / HEAD)  # [tokens, HEAD/2]
    c, s = np.cos(theta)[:, None, :], np.sin(theta)[:, None, :]
    x0, x1 = x[..., 0::2], x[..., 1::2]
    out = np.empty_like(x)
    out[..., 0::2], out[..., 1::2] = x0 * c - x1 * s, x0 * s + x1 * c
    return out


def attend(q, k, v, mask):
    """q [t, N_HEAD, HEAD], k / v [cells, N_HEAD_KV, HEAD], mask [t, cells] (0 or -inf) -> [t, N_HEAD * HEAD]."""
    kh = np.repeat(k, N_HEAD // N_HEAD_KV, axis=1)  # grouped-query: each KV head serves 2 query heads
    vh = np.repeat(v, N_HEAD // N_HEAD_KV, axis=1)
    s = np.einsum("thd,chd->htc", q, kh) / np.sqrt(HEAD) + mask[None]
    w = np.exp(s - s.max(axis=-1, keepdims=True))
    w /= w.sum(axis=-1, keepdims=True)
    return np.einsum("htc,chd->thd", w, vh).reshape(len(q), -1)


def decode(mem, batch):
    """One llama_decode through the cache: logits of the batch's output tokens, in batch order."""
    ctx = mem.init_batch(batch, n_ubatch=5)
    rows = {}
    for ub in ctx:  # applies each ubatch in turn
        x, pos = W["emb"][ub.token], ub.pos.astype(np.float32)
        for il in range(N_LAYER):
            a = ctx.attn(il)
            q = rope((x @ W["q"][il]).reshape(-1, N_HEAD, HEAD), pos)
            a.cpy_k(il, rope((x @ W["k"][il]).reshape(-1, N_HEAD_KV, HEAD), pos))
            a.cpy_v(il, x @ W["v"][il])
            k, v = a.get_k(il)[0], a.get_v(il)[0]  # zero-copy views [n_kv, N_HEAD_KV, HEAD] (one stream)
            x = x + attend(q, k, v, a.kq_mask()) @ W["o"][il]
        for t in np.flatnonzero(ub.output):
            rows[ub.batch_idx[t]] = x[t] @ W["out"]
    return np.array([rows[i] for i in sorted(rows)])


class Plain:
    """The reference: each sequence's pre-RoPE keys and values per layer in plain lists, no kvcache; every
    token attends over its sequence's entries, keys rotated to their current positions (as reference_memory)."""

    def __init__(self):
        self.seq = {}  # seq -> list of [pos, [k per layer], [v per layer]]

    def step(self, s, tok, pos):
        x, ent = W["emb"][tok][None], [pos, [], []]
        self.seq.setdefault(s, []).append(ent)
        for il in range(N_LAYER):
            ent[1].append((x @ W["k"][il]).reshape(1, N_HEAD_KV, HEAD))
            ent[2].append((x @ W["v"][il]).reshape(1, N_HEAD_KV, HEAD))
            hist = self.seq[s]
            p = np.array([e[0] for e in hist], dtype=np.float32)
            k = np.concatenate([rope(e[1][il], p[i:i + 1]) for i, e in enumerate(hist)])
            v = np.concatenate([e[2][il] for e in hist])
            q = rope((x @ W["q"][il]).reshape(1, N_HEAD, HEAD), np.array([pos], dtype=np.float32))
            x = x + attend(q, k, v, np.where(p <= pos, 0.0, -np.inf)[None]) @ W["o"][il]
        return (x @ W["out"])[0]

    def rm(self, s, p0, p1):
        self.seq[s] = [e for e in self.seq[s] if not p0 <= e[0] < p1]

    def add(self, s, p0, d):
        for e in self.seq[s]:
            e[0] += d if e[0] >= p0 else 0


def main():
    layer = kvcache.LayerDesc(n_head_kv=N_HEAD_KV, n_embd_head_k=HEAD, n_embd_head_v=HEAD,
                              rope=kvcache.RopeParams(type="normal", n_rot=HEAD))
    cache = kvcache.KVCache(layers=[layer] * N_LAYER, type_k="f32", type_v="f32", v_trans=False, kv_size=128,
                            n_seq_max=3, n_kv_pad=16, prefix=kvcache.PrefixCacheParams(enabled=True, block_size=4))
    ref, worst = Plain(), 0.0

    def run(toks, pos, seq_ids):  # one batch through the cache and the same tokens through the reference
        nonlocal worst
        out = decode(cache, kvcache.Batch(tokens=toks, pos=pos, seq_ids=seq_ids, logits=[1] * len(toks)))
        for i, (t, p, s) in enumerate(zip(toks, pos, seq_ids)):
            r = ref.step(s, t, p)
            worst = max(worst, float(np.abs(out[i] - r).max() / np.abs(r).max()))
        return out

    # 1. two prompts in one batch (three ubatches of at most 5 tokens)
    p0, p1 = [int(t) for t in rng.integers(0, N_VOCAB, 13)], [int(t) for t in rng.integers(0, N_VOCAB, 7)]
    out = run(p0 + p1, list(range(13)) + list(range(7)), [0] * 13 + [1] * 7)
    # 2. generation: the argmax of each sequence, both in one batch, four steps
    last = [out[12], out[19]]
    for step in range(4):
        nxt = [int(last[0].argmax()), int(last[1].argmax())]
        last = run(nxt, [13 + step, 7 + step], [0, 1])
    # 3. a prefix hit: sequence 2's prompt starts with sequence 0's first 12 tokens (3 blocks of 4); the
    #    cache gives their cells to sequence 2 at once, and it decodes only its tail
    cache.prefix_publish()
    p2 = p0[:12] + [5, 6, 7]
    n = cache.prefix_attach(2, p2)
    ref.seq[2] = [e for e in ref.seq[0] if e[0] < n]  # the reference copies what the cache shares
    run(p2[n:], list(range(n, len(p2))), [2] * (len(p2) - n))
    # 4. a context shift of sequence 1: drop positions [2, 6), slide the rest down by 4; the next decode
    #    re-rotates the moved keys (K-shift) before placing the batch
    cache.seq_rm(1, 2, 6)
    cache.seq_add(1, 6, -1, -4)
    ref.rm(1, 2, 6)
    ref.add(1, 6, -4)
    run([9], [cache.seq_pos_max(1) + 1], [1])

    print(f"prefix hit: {n} of {len(p2)} tokens; {cache.prefix_stats()}")
    print(f"worst relative logit difference, cache vs recompute: {worst:.2e}")
    ok = n == 12 and worst < 1e-4
    print("cache == recompute" if ok else "MISMATCH")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
