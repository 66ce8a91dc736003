"""Shared test reference: block-sparse decode attention by brute force in float64."""
import numpy as np


def brute_force_sparse_decode(q, k, v, page_idx, page_valid, positions, scale=None):
    """Softmax over the distinct valid in-range pages' tokens at <= position, one head at a time.

    q [B, H, D]; k, v [B, Hkv, P, S, D]; page_idx, page_valid [B, Hkv, N]; positions [B].
    Returns [B, H, D] float64.
    """
    b, heads, dim = q.shape
    _, kv_heads, pages, page_size, _ = k.shape
    group = heads // kv_heads
    scale = dim ** -0.5 if scale is None else scale
    out = np.zeros(q.shape, np.float64)
    for bi in range(b):
        for h in range(heads):
            kh = h // group
            chosen = {int(p) for p, ok in zip(page_idx[bi, kh], page_valid[bi, kh]) if ok and 0 <= p < pages}
            toks = [(p, s) for p in sorted(chosen) for s in range(page_size) if p * page_size + s <= positions[bi]]
            keys = np.array([k[bi, kh, p, s] for p, s in toks], np.float64)
            vals = np.array([v[bi, kh, p, s] for p, s in toks], np.float64)
            logits = keys @ q[bi, h].astype(np.float64) * scale
            w = np.exp(logits - logits.max())
            out[bi, h] = (w / w.sum()) @ vals
    return out
