"""Per-token mismatch between the dense policy p and the sparse actor q (Sparrow §3).

Everything is exact over the full vocabulary and computed in float32 from logits
(``[..., V]``) or, for big vocabularies, from final hidden states and the unembedding
matrix in vocabulary chunks (:func:`mismatch_stats`), never holding ``[..., V]`` logits.

Numerics: all measures go through log-softmax, so logits may be ``-inf`` (masked
entries), very peaked, or of magnitude ~1e4. A row whose logits are all ``-inf`` is
not a distribution and gives NaN.

  acceptance  alpha = sum_x min(p, q) = exp(logsumexp(min(log p, log q)))  in [0, 1]
  total var.  tv    = 0.5 * sum_x |p - q|   (= 1 - alpha, computed directly)
  KL          KL(p || q) = sum_x p (log p - log q), 0 log 0 = 0, +inf if q = 0 < p.

Temperature: the sampling distribution at temperature T is softmax(logits / T); pass
``logits / T`` here, or ``hidden / T`` to :func:`mismatch_stats` (logits are linear in
the hidden state).
"""
from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

Array = Any  # jax.Array or anything jnp.asarray accepts

_NEG_INF = -jnp.inf


def _check_pair(name_a: str, a: Array, name_b: str, b: Array, min_ndim: int = 1):
    """Same shape, floating, at least ``min_ndim`` dims with a non-empty last axis."""
    a, b = jnp.asarray(a), jnp.asarray(b)
    if a.shape != b.shape:
        raise ValueError(f"{name_a} and {name_b} must have the same shape, got "
                         f"{tuple(a.shape)} vs {tuple(b.shape)}")
    for name, x in ((name_a, a), (name_b, b)):
        if not jnp.issubdtype(x.dtype, jnp.floating):
            raise TypeError(f"{name}: expected a floating dtype, got {x.dtype}")
        if x.ndim < min_ndim or x.shape[-1] < 1:
            raise ValueError(f"{name}: expected shape [..., V] with V >= 1, got {tuple(x.shape)}")
    return a.astype(jnp.float32), b.astype(jnp.float32)


def _log_softmax(logits: jax.Array) -> jax.Array:
    # jax.nn.log_softmax subtracts the row max first: exact for huge magnitudes, and
    # -inf entries stay -inf (as long as one entry of the row is finite).
    return jax.nn.log_softmax(logits, axis=-1)


def _min_mass(lp: jax.Array, lq: jax.Array) -> jax.Array:
    """sum_x min(p, q) from log-probs, via logsumexp of the elementwise min. [..., V] -> [...]"""
    # logsumexp of an all -inf row is -inf (jax guards the max shift), so disjoint
    # supports give exp(-inf) = 0 exactly.
    return jnp.exp(jax.nn.logsumexp(jnp.minimum(lp, lq), axis=-1))


def _kl_terms(lp: jax.Array, lq: jax.Array) -> jax.Array:
    """Elementwise p (log p - log q) with 0 log 0 = 0 and +inf where q = 0 < p."""
    p_zero = lp == _NEG_INF
    q_zero = lq == _NEG_INF
    # where-guards keep inf - inf / 0 * inf out of the finite branch.
    diff = jnp.where(p_zero | q_zero, 0.0, lp - lq)
    term = jnp.exp(lp) * diff
    return jnp.where(p_zero, 0.0, jnp.where(q_zero, jnp.inf, term))


def _entropy_terms(lp: jax.Array) -> jax.Array:
    """Elementwise -p log p with 0 log 0 = 0."""
    p_zero = lp == _NEG_INF
    return jnp.where(p_zero, 0.0, -jnp.exp(lp) * jnp.where(p_zero, 0.0, lp))


def acceptance_rate(logits_p: Array, logits_q: Array) -> jax.Array:
    """Exact per-token acceptance rate alpha = sum_x min(p(x), q(x)).

    Args:
      logits_p: dense-policy logits, float [..., V].
      logits_q: sparse-actor logits, float [..., V] (same shape).
    Returns:
      float32 [...], clipped to [0, 1]: 1 when p == q, 0 for disjoint supports.
    """
    return _acceptance_jit(*_check_pair("logits_p", logits_p, "logits_q", logits_q))


@jax.jit
def _acceptance_jit(zp, zq):
    return jnp.clip(_min_mass(_log_softmax(zp), _log_softmax(zq)), 0.0, 1.0)


def total_variation(logits_p: Array, logits_q: Array) -> jax.Array:
    """Total variation 0.5 * sum_x |p(x) - q(x)| (= 1 - alpha). float [..., V] -> float32 [...] in [0, 1]."""
    return _tv_jit(*_check_pair("logits_p", logits_p, "logits_q", logits_q))


@jax.jit
def _tv_jit(zp, zq):
    p, q = jnp.exp(_log_softmax(zp)), jnp.exp(_log_softmax(zq))
    return jnp.clip(0.5 * jnp.sum(jnp.abs(p - q), axis=-1), 0.0, 1.0)


def kl_divergence(logits_p: Array, logits_q: Array) -> jax.Array:
    """KL(p || q) = sum_x p (log p - log q). float [..., V] -> float32 [...] >= 0.

    Entries with p = 0 contribute 0; an entry with q = 0 < p makes the result +inf.
    """
    return _kl_jit(*_check_pair("logits_p", logits_p, "logits_q", logits_q))


@jax.jit
def _kl_jit(zp, zq):
    kl = jnp.sum(_kl_terms(_log_softmax(zp), _log_softmax(zq)), axis=-1)
    return jnp.maximum(kl, 0.0)  # rounding can go a hair below 0 when p ~ q


def acceptance_rate_from_topk(ids_p: Array, logprobs_p: Array,
                              ids_q: Array, logprobs_q: Array) -> jax.Array:
    """Top-k approximation of alpha from each side's top-k (token id, log-prob) lists.

    This is what an inference engine returning top-k log-probs (SGLang ``top_logprobs``)
    allows. A token's probability is known on a side only if it is in that side's list;
    an unknown value is treated as 0, so ``min(p, q)`` is non-zero only for tokens in
    BOTH lists:  ``alpha_k = sum_{x in ids_p ∩ ids_q} min(p(x), q(x)) <= alpha``.
    It is a lower bound of the exact alpha (a sum over a subset of the non-negative
    terms), and equals it when both lists cover the supports.

    Args:
      ids_p, ids_q: int [..., k] token ids (distinct within a row).
      logprobs_p, logprobs_q: float [..., k] log-probs normalised over the FULL vocabulary.
    Returns:
      float32 [...] in [0, 1].
    """
    ids_p, ids_q = jnp.asarray(ids_p), jnp.asarray(ids_q)
    lp, lq = _check_pair("logprobs_p", logprobs_p, "logprobs_q", logprobs_q)
    for name, ids, lps in (("ids_p", ids_p, lp), ("ids_q", ids_q, lq)):
        if ids.shape != lps.shape:
            raise ValueError(f"{name}: expected the shape of its log-probs {tuple(lps.shape)}, "
                             f"got {tuple(ids.shape)}")
        if not jnp.issubdtype(ids.dtype, jnp.integer):
            raise TypeError(f"{name}: expected an integer dtype, got {ids.dtype}")
    return _from_topk_jit(ids_p, lp, ids_q, lq)


@jax.jit
def _from_topk_jit(ids_p, lp, ids_q, lq):
    same = ids_p[..., :, None] == ids_q[..., None, :]           # [..., k, k]
    in_q = jnp.any(same, axis=-1)                               # ids_p[i] in ids_q
    # log q at each of p's ids (-inf where not listed by q); at most one match per row.
    lq_at_p = jnp.max(jnp.where(same, lq[..., None, :], _NEG_INF), axis=-1)
    terms = jnp.where(in_q, jnp.exp(jnp.minimum(lp, lq_at_p)), 0.0)
    return jnp.clip(jnp.sum(terms, axis=-1), 0.0, 1.0)


def topk_acceptance_rate(logits_p: Array, logits_q: Array, k: int = 20) -> jax.Array:
    """The paper's top-k approximation of alpha (k = 20 in the release); a lower bound.

    Takes each side's top-k tokens (``lax.top_k``: ties go to the lower id) with their
    exact full-vocabulary log-probs and applies :func:`acceptance_rate_from_topk`: only
    tokens in topk(p) ∩ topk(q) contribute ``min(p, q)``. ``k >= V`` gives the exact alpha.

    Args:
      logits_p, logits_q: float [..., V] (same shape).
      k: list length per side, >= 1 (clamped to V).
    Returns:
      float32 [...] in [0, 1], always <= :func:`acceptance_rate`.
    """
    if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or k < 1:
        raise ValueError(f"k: expected an int >= 1, got {k!r}")
    zp, zq = _check_pair("logits_p", logits_p, "logits_q", logits_q)
    return _topk_jit(zp, zq, k=min(int(k), zp.shape[-1]))


@functools.partial(jax.jit, static_argnames=("k",))
def _topk_jit(zp, zq, *, k):
    top_lp, ids_p = lax.top_k(_log_softmax(zp), k)
    top_lq, ids_q = lax.top_k(_log_softmax(zq), k)
    return _from_topk_jit(ids_p, top_lp, ids_q, top_lq)


# --------------------------------------------------------------------------------------
# Vocabulary-chunked, fused statistics from hidden states.
# --------------------------------------------------------------------------------------

def mismatch_stats(hidden_p: Array, hidden_q: Array, unembed: Array,
                   vocab_chunk: int = 8192, sampled_tokens: Array | None = None, *,
                   unembed_q: Array | None = None, reverse_kl: bool = False,
                   precision: lax.Precision = lax.Precision.HIGHEST) -> dict[str, jax.Array]:
    """Exact mismatch statistics without materialising [..., V] logits.

    Logits are ``hidden @ unembed``. Two scans over vocabulary chunks of ``vocab_chunk``
    columns: pass 1 an online logsumexp of p and q (and the logits of the sampled
    tokens), pass 2 sums of min(p, q), |p - q|, p log(p/q) and -p log p. Peak memory is
    ~N * vocab_chunk floats per side (N = number of tokens), so callers with long
    sequences should also chunk over tokens.

    When V is not a multiple of ``vocab_chunk`` the last chunk is slid back to end at
    V and the columns already covered are masked to -inf (the same result as padding
    with -inf, without copying the [H, V] matrix).

    Args:
      hidden_p: dense-policy final hidden states (after the final norm), float [..., H].
      hidden_q: sparse-actor final hidden states, float [..., H] (same shape).
      unembed: float [H, V] (the tied embedding's transpose or lm_head); cast to
        float32 one chunk at a time.
      vocab_chunk: columns per chunk, >= 1 (clamped to V).
      sampled_tokens: optional int [...] token ids (the rollout's tokens). Ids outside
        [0, V) match no column and give log-prob -inf.
      unembed_q: optional separate [H, V] unembedding for q (default: ``unembed``).
      reverse_kl: also return ``kl_reverse`` = KL(q||p) (one more term per logit in pass 2).
      precision: matmul precision; HIGHEST keeps float32 on GPU/TPU (no TF32/bf16 passes).
    Returns:
      dict of float32 [...] arrays: ``alpha`` (in [0, 1]), ``tv`` (in [0, 1]), ``kl``
      (KL(p||q) >= 0), ``entropy_p`` (nats), only when ``sampled_tokens`` is given,
      ``logp_p_sampled`` and ``logp_q_sampled``, and only with ``reverse_kl``, ``kl_reverse``.
    """
    hp, hq = _check_pair("hidden_p", hidden_p, "hidden_q", hidden_q)
    w_p = jnp.asarray(unembed)
    w_q = w_p if unembed_q is None else jnp.asarray(unembed_q)
    for name, w in (("unembed", w_p), ("unembed_q", w_q)):
        if w.ndim != 2 or w.shape[0] != hp.shape[-1] or w.shape[1] < 1:
            raise ValueError(f"{name}: expected shape [H={hp.shape[-1]}, V>=1], got {tuple(w.shape)}")
        if not jnp.issubdtype(w.dtype, jnp.floating):
            raise TypeError(f"{name}: expected a floating dtype, got {w.dtype}")
    if w_q.shape != w_p.shape:
        raise ValueError(f"unembed_q: expected the shape of unembed {tuple(w_p.shape)}, got {tuple(w_q.shape)}")
    if isinstance(vocab_chunk, bool) or not isinstance(vocab_chunk, (int, np.integer)) or vocab_chunk < 1:
        raise ValueError(f"vocab_chunk: expected an int >= 1, got {vocab_chunk!r}")
    lead = hp.shape[:-1]
    tokens = None
    if sampled_tokens is not None:
        tokens = jnp.asarray(sampled_tokens)
        if tokens.shape != lead:
            raise ValueError(f"sampled_tokens: expected shape {tuple(lead)} (hidden states' leading "
                             f"dims), got {tuple(tokens.shape)}")
        if not jnp.issubdtype(tokens.dtype, jnp.integer):
            raise TypeError(f"sampled_tokens: expected an integer dtype, got {tokens.dtype}")
        tokens = tokens.reshape(-1).astype(jnp.int32)
    h = hp.shape[-1]
    out = _mismatch_stats_flat(hp.reshape(-1, h), hq.reshape(-1, h), w_p, w_q, tokens,
                               vocab_chunk=min(int(vocab_chunk), w_p.shape[1]),
                               reverse_kl=bool(reverse_kl), precision=precision)
    return {name: v.reshape(lead) for name, v in out.items()}


def _online_lse_update(m: jax.Array, s: jax.Array, x: jax.Array):
    """One step of a streaming logsumexp over the last axis. m, s: [N]; x: [N, C]."""
    m_new = jnp.maximum(m, jnp.max(x, axis=-1))
    # Shift by 0 while everything seen is -inf, so exp never sees (-inf) - (-inf).
    shift = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
    s = s * jnp.exp(m - shift) + jnp.sum(jnp.exp(x - shift[:, None]), axis=-1)
    return m_new, s


@functools.partial(jax.jit, static_argnames=("vocab_chunk", "reverse_kl", "precision"))
def _mismatch_stats_flat(hp, hq, w_p, w_q, tokens, *, vocab_chunk, reverse_kl, precision):
    n = hp.shape[0]
    vocab = w_p.shape[1]
    c = vocab_chunk
    num_chunks = -(-vocab // c)

    def chunk_logits(i):
        first = i * c                              # first column this chunk owns
        start = jnp.minimum(first, vocab - c)      # slide the last chunk back inside V
        cols = start + jnp.arange(c)
        owned = cols >= first                      # mask columns the previous chunk had

        def logits(hidden, w):
            w_c = lax.dynamic_slice_in_dim(w, start, c, axis=1).astype(jnp.float32)
            z = jnp.dot(hidden, w_c, precision=precision)
            return jnp.where(owned[None, :], z, _NEG_INF)

        return cols, owned, logits(hp, w_p), logits(hq, w_q)

    zeros = jnp.zeros((n,), jnp.float32)
    neg = jnp.full((n,), _NEG_INF, jnp.float32)

    def pass1(carry, i):
        m_p, s_p, m_q, s_q, tok_p, tok_q = carry
        cols, owned, zp, zq = chunk_logits(i)
        m_p, s_p = _online_lse_update(m_p, s_p, zp)
        m_q, s_q = _online_lse_update(m_q, s_q, zq)
        if tokens is not None:
            hit = (cols[None, :] == tokens[:, None]) & owned[None, :]   # at most one per row
            tok_p = jnp.maximum(tok_p, jnp.max(jnp.where(hit, zp, _NEG_INF), axis=-1))
            tok_q = jnp.maximum(tok_q, jnp.max(jnp.where(hit, zq, _NEG_INF), axis=-1))
        return (m_p, s_p, m_q, s_q, tok_p, tok_q), None

    (m_p, s_p, m_q, s_q, tok_p, tok_q), _ = lax.scan(
        pass1, (neg, zeros, neg, zeros, neg, neg), jnp.arange(num_chunks))

    def finish_lse(m, s):
        return jnp.where(jnp.isfinite(m), m, 0.0) + jnp.log(s)

    lse_p, lse_q = finish_lse(m_p, s_p), finish_lse(m_q, s_q)

    def pass2(carry, i):
        a, tv, kl, ent, kl_rev = carry
        _, _, zp, zq = chunk_logits(i)
        lp = zp - lse_p[:, None]
        lq = zq - lse_q[:, None]
        a = a + jnp.sum(jnp.exp(jnp.minimum(lp, lq)), axis=-1)
        tv = tv + jnp.sum(jnp.abs(jnp.exp(lp) - jnp.exp(lq)), axis=-1)
        kl = kl + jnp.sum(_kl_terms(lp, lq), axis=-1)
        ent = ent + jnp.sum(_entropy_terms(lp), axis=-1)
        if reverse_kl:
            kl_rev = kl_rev + jnp.sum(_kl_terms(lq, lp), axis=-1)
        return (a, tv, kl, ent, kl_rev), None

    (a, tv, kl, ent, kl_rev), _ = lax.scan(pass2, (zeros, zeros, zeros, zeros, zeros), jnp.arange(num_chunks))
    out = {
        "alpha": jnp.clip(a, 0.0, 1.0),
        "tv": jnp.clip(0.5 * tv, 0.0, 1.0),
        "kl": jnp.maximum(kl, 0.0),
        "entropy_p": jnp.maximum(ent, 0.0),
    }
    if tokens is not None:
        out["logp_p_sampled"] = tok_p - lse_p
        out["logp_q_sampled"] = tok_q - lse_q
    if reverse_kl:
        out["kl_reverse"] = jnp.maximum(kl_rev, 0.0)
    return out
