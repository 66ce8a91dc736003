"""Tests for sparrow_jax.rl: advantages, TIS weights, PPO-clip policy loss, aggregation, KL.

Expected numbers are written out per token by hand (plain Python / math / statistics),
independently of the implementation.
"""
import functools
import math
import statistics

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sparrow_jax.rl import (LOSS_AGG_MODES, agg_loss, group_advantages, grpo_loss, kl_penalty, policy_loss,
                            tis_weights, tis_weights_and_keep)

RTOL = 1e-5
ATOL = 1e-6


def close(a, b, rtol=RTOL, atol=ATOL):
    np.testing.assert_allclose(np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64),
                               rtol=rtol, atol=atol)


# ----------------------------------------------------------------------------- advantages
REWARDS = [1.0, 0.0, 0.0, 0.0, 3.0, 1.0, 2.0, 2.0, 5.0, 5.0, 5.0, 5.0]


def test_grpo_advantages_unbiased_std():
    eps = 1e-6
    adv = group_advantages(jnp.array(REWARDS), group_size=4, mode="grpo", eps=eps)
    expected = []
    for g in range(3):
        grp = REWARDS[4 * g: 4 * g + 4]
        mu = sum(grp) / 4
        sd = statistics.stdev(grp)  # unbiased (n - 1), like torch.std in verl
        expected += [(r - mu) / (sd + eps) for r in grp]
    close(adv, expected)
    # Group 0 by hand: mean 0.25, unbiased std sqrt((0.75^2 + 3 * 0.25^2) / 3) = 0.5.
    close(adv[:4], [0.75 / (0.5 + eps)] + [-0.25 / (0.5 + eps)] * 3)
    close(adv[8:], [0.0] * 4)  # a constant group carries no signal


def test_drgrpo_advantages_no_std():
    adv = group_advantages(jnp.array(REWARDS), group_size=4, mode="drgrpo")
    close(adv, [0.75, -0.25, -0.25, -0.25, 1.0, -1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0])


def test_group_size_one_follows_verl_and_jit():
    # verl: a lone sample has mean 0 and std 1.
    close(group_advantages(jnp.array([2.0, -1.0]), 1, "grpo"), [2.0 / (1 + 1e-6), -1.0 / (1 + 1e-6)])
    close(group_advantages(jnp.array([2.0, -1.0]), 1, "drgrpo"), [2.0, -1.0])
    jitted = jax.jit(functools.partial(group_advantages, group_size=4, mode="grpo"))
    close(jitted(jnp.array(REWARDS)), group_advantages(jnp.array(REWARDS), 4, "grpo"))
    # Integer rewards are promoted to float.
    close(group_advantages(jnp.array([1, 0]), 2, "drgrpo"), [0.5, -0.5])


def test_advantage_errors():
    with pytest.raises(ValueError, match="N=5 is not a multiple of group_size=4"):
        group_advantages(jnp.ones(5), 4)
    with pytest.raises(ValueError, match="mode"):
        group_advantages(jnp.ones(4), 2, mode="gspo")
    with pytest.raises(ValueError, match="group_size"):
        group_advantages(jnp.ones(4), 0)
    with pytest.raises(ValueError, match="1-D"):
        group_advantages(jnp.ones((2, 2)), 2)


# ----------------------------------------------------------------------------- policy loss
# Two rows, A = +1 and A = -1; ratios r = pi/pi_old chosen to hit every branch.
R = [[1.5, 1.1, 0.5], [0.5, 1.2, 5.0]]
LOGP_OLD = [[-1.0, -0.5, -2.0], [-0.3, -1.2, -0.7]]
LOGP = [[o + math.log(r) for o, r in zip(ro, rr)] for ro, rr in zip(LOGP_OLD, R)]
ADV = [1.0, -1.0]
# Per-token loss = -min(r A, clip(r, 0.8, 1.28) A), then max with -(c A) for A < 0 (dual clip).
#   (0,0) A=+1 r=1.5 : clipped to 1.28            -> -1.28  (pg_clipfrac)
#   (0,1) A=+1 r=1.1 : inside                      -> -1.1
#   (0,2) A=+1 r=0.5 : r A < clip A, unclipped     -> -0.5
#   (1,0) A=-1 r=0.5 : min(-0.5, -0.8) = -0.8      ->  0.8   (pg_clipfrac)
#   (1,1) A=-1 r=1.2 : inside                      ->  1.2
#   (1,2) A=-1 r=5.0 : min(-5, -1.28) = -5         ->  5.0, dual clip c=3 -> 3.0 (clipfrac_lower)
LOSS_NO_DUAL = [[-1.28, -1.1, -0.5], [0.8, 1.2, 5.0]]
LOSS_DUAL = [[-1.28, -1.1, -0.5], [0.8, 1.2, 3.0]]


def _arrays():
    return jnp.array(LOGP), jnp.array(LOGP_OLD), jnp.array(ADV)


def test_policy_loss_clip_higher_and_dual_clip():
    logp, logp_old, adv = _arrays()
    mask = jnp.ones((2, 3))
    loss, m = policy_loss(logp, logp_old, adv, mask, 0.2, 0.28, dual_clip_c=3.0)
    close(loss, sum(sum(r) for r in LOSS_DUAL) / 6)
    close(m["actor/pg_clipfrac"], 2 / 6)
    close(m["actor/pg_clipfrac_lower"], 1 / 6)
    close(m["actor/ppo_kl"], sum(-math.log(r) for row in R for r in row) / 6)
    close(m["actor/pg_loss"], loss)

    loss_nd, m_nd = policy_loss(logp, logp_old, adv, mask, 0.2, 0.28, dual_clip_c=None)
    close(loss_nd, sum(sum(r) for r in LOSS_NO_DUAL) / 6)
    close(m_nd["actor/pg_clipfrac_lower"], 0.0)

    # [B, T] advantages give the same result as [B].
    adv_bt = jnp.array([[1.0] * 3, [-1.0] * 3])
    close(policy_loss(logp, logp_old, adv_bt, mask, dual_clip_c=3.0)[0], loss)


def test_policy_loss_mask_and_gradient():
    logp, logp_old, adv = _arrays()
    # Mask out (0,2); put garbage there to check that it cannot leak (not even as NaN).
    mask = jnp.array([[1, 1, 0], [1, 1, 1]], dtype=bool)
    logp = logp.at[0, 2].set(jnp.nan)
    loss, m = policy_loss(logp, logp_old, adv, mask, dual_clip_c=3.0)
    close(loss, (-1.28 - 1.1 + 0.8 + 1.2 + 3.0) / 5)
    close(m["actor/pg_clipfrac"], 2 / 5)
    close(m["actor/pg_clipfrac_lower"], 1 / 5)

    # d loss / d logp: clipped tokens and the dual-clipped token have zero gradient;
    # otherwise d(-A r)/d logp = -A r, divided by the 5 masked tokens.
    g = jax.grad(lambda lp: policy_loss(lp, logp_old, adv, mask, dual_clip_c=3.0)[0])(logp)
    close(g, [[0.0, -1.1 / 5, 0.0], [0.0, 1.2 / 5, 0.0]])
    # Old log-probs and advantages are constants.
    g_old = jax.grad(lambda lo: policy_loss(logp, lo, adv, mask, dual_clip_c=3.0)[0])(logp_old)
    close(g_old, np.zeros((2, 3)))


def test_policy_loss_aggregation_modes_ragged():
    logp, logp_old, adv = _arrays()
    mask = jnp.array([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    # Kept per-token losses (dual clip): row0 [-1.28, -1.1], row1 [0.8].
    expect = {
        "token-mean": (-1.28 - 1.1 + 0.8) / 3,
        "seq-mean-token-mean": ((-1.28 - 1.1) / 2 + 0.8 / 1) / 2,
        "seq-mean-token-sum": ((-1.28 - 1.1) + 0.8) / 2,
        "seq-mean-token-sum-norm": ((-1.28 - 1.1) + 0.8) / 2 / 3,
    }
    for mode, want in expect.items():
        loss, _ = policy_loss(logp, logp_old, adv, mask, dual_clip_c=3.0, agg=mode)
        close(loss, want)


def test_policy_loss_with_is_weights_and_no_gradient_through_them():
    logp, logp_old, adv = _arrays()
    mask = jnp.ones((2, 3))
    w = jnp.array([[0.5, 2.0, 3.0], [1.0, 3.0, 0.0]])
    loss, _ = policy_loss(logp, logp_old, adv, mask, dual_clip_c=3.0, is_weights=w)
    want = sum(wi * li for wr, lr in zip(w.tolist(), LOSS_DUAL) for wi, li in zip(wr, lr)) / 6
    close(loss, want)
    gw = jax.grad(lambda ww: policy_loss(logp, logp_old, adv, mask, is_weights=ww)[0])(w)
    close(gw, np.zeros((2, 3)))


def test_policy_loss_jit_matches_eager():
    logp, logp_old, adv = _arrays()
    mask = jnp.array([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    f = functools.partial(policy_loss, clip_low=0.2, clip_high=0.28, dual_clip_c=3.0,
                          agg="seq-mean-token-mean")
    eager = f(logp, logp_old, adv, mask)
    jitted = jax.jit(f)(logp, logp_old, adv, mask)
    close(jitted[0], eager[0])
    for k in eager[1]:
        close(jitted[1][k], eager[1][k])


# ----------------------------------------------------------------------------- TIS
SAMPLER = [[-1.0, -2.0, -0.5], [-0.7, -3.0, -1.5]]
TIS_MASK = [[1, 1, 1], [1, 1, 0]]
TOKEN_RATIOS = [[0.25, 2.0, 4.0], [1.0, 10.0, 100.0]]  # (1,2) is masked


def _tis_inputs(ratios):
    dense = [[s + math.log(r) for s, r in zip(sr, rr)] for sr, rr in zip(SAMPLER, ratios)]
    return jnp.array(dense), jnp.array(SAMPLER)


def test_tis_token_level_cap_and_metrics():
    dense, sampler = _tis_inputs(TOKEN_RATIOS)
    sampler = sampler.at[1, 2].set(jnp.nan)  # padding garbage must not matter
    w, m = tis_weights(dense, sampler, jnp.array(TIS_MASK), cap=3.0, level="token")
    close(w, [[0.25, 2.0, 3.0], [1.0, 3.0, 0.0]])
    valid = [0.25, 2.0, 4.0, 1.0, 10.0]
    applied = [0.25, 2.0, 3.0, 1.0, 3.0]
    p = "rollout_corr/"
    close(m[p + "rollout_is_raw_mean"], sum(valid) / 5)
    close(m[p + "rollout_is_raw_max"], 10.0)
    close(m[p + "rollout_is_raw_min"], 0.25)
    close(m[p + "rollout_is_mean"], sum(applied) / 5)
    close(m[p + "rollout_is_max"], 3.0)
    close(m[p + "rollout_is_min"], 0.25)
    close(m[p + "rollout_is_ratio_fraction_high"], 2 / 5)  # 4 and 10 are capped
    close(m[p + "rollout_is_ratio_fraction_low"], 1 / 5)  # 0.25 < 1/3
    close(m[p + "rollout_is_oob_ratio"], 0.0)
    mean_w = sum(applied) / 5
    close(m[p + "rollout_is_eff_sample_size"], mean_w ** 2 / (sum(a * a for a in applied) / 5))
    close(m[p + "kl"], sum(-math.log(r) for r in valid) / 5)
    close(m[p + "k3_kl"], sum(r - math.log(r) - 1 for r in valid) / 5)
    for v in m.values():
        assert np.isfinite(float(v))


def test_tis_token_level_ratio_bounds_mask():
    dense, sampler = _tis_inputs(TOKEN_RATIOS)
    w, keep, m = tis_weights_and_keep(dense, sampler, jnp.array(TIS_MASK), cap=3.0,
                                      level="token", mask_ratio_bounds=(0.2, 5.0))
    # 10 is outside [0.2, 5] -> weight 0 and dropped; 4 is inside but capped to 3.
    close(w, [[0.25, 2.0, 3.0], [1.0, 0.0, 0.0]])
    np.testing.assert_array_equal(np.asarray(keep), [[True, True, True], [True, False, False]])
    close(m["rollout_corr/rollout_is_oob_ratio"], 1 / 5)
    close(m["rollout_corr/rollout_is_seq_masked_fraction"], 1 / 2)
    # Lower fraction uses the lower bound when bounds are given: 0.25 >= 0.2.
    close(m["rollout_corr/rollout_is_ratio_fraction_low"], 0.0)

    # Raising the lower bound to 0.5 also rejects 0.25 (below lo).
    w, keep, m = tis_weights_and_keep(dense, sampler, jnp.array(TIS_MASK), cap=3.0,
                                      level="token", mask_ratio_bounds=(0.5, 5.0))
    close(w, [[0.0, 2.0, 3.0], [1.0, 0.0, 0.0]])
    np.testing.assert_array_equal(np.asarray(keep), [[False, True, True], [True, False, False]])
    close(m["rollout_corr/rollout_is_oob_ratio"], 2 / 5)
    close(m["rollout_corr/rollout_is_seq_masked_fraction"], 2 / 2)
    close(m["rollout_corr/rollout_is_ratio_fraction_low"], 1 / 5)


def test_tis_sequence_level_cap_and_mask():
    ratios = [[0.5, 2.0, 4.0], [1.0, 1.5, 7.0], [3.0, 3.0, 3.0]]
    sampler = jnp.array(SAMPLER + [[-1.0, -1.0, -1.0]])
    dense = jnp.array([[s + math.log(r) for s, r in zip(sr, rr)]
                       for sr, rr in zip(SAMPLER + [[-1.0, -1.0, -1.0]], ratios)])
    mask = jnp.array(TIS_MASK + [[0, 0, 0]])  # row 2 fully masked; (1,2) masked
    # Row 0: 0.5*2*4 = 4 -> capped to 3. Row 1: 1*1.5 = 1.5 (7 is masked). Row 2: no tokens.
    w, m = tis_weights(dense, sampler, mask, cap=3.0, level="sequence")
    close(w, [[3.0, 3.0, 3.0], [1.5, 1.5, 0.0], [0.0, 0.0, 0.0]])
    p = "rollout_corr/"
    close(m[p + "rollout_is_raw_mean"], (4.0 + 1.5) / 2)  # per sequence
    close(m[p + "rollout_is_raw_max"], 4.0)
    close(m[p + "rollout_is_raw_min"], 1.5)
    close(m[p + "rollout_is_ratio_fraction_high"], 1 / 2)
    close(m[p + "rollout_is_mean"], (3 * 3.0 + 2 * 1.5) / 5)  # per valid token

    w, keep, m = tis_weights_and_keep(dense, sampler, mask, cap=3.0, level="sequence",
                                      mask_ratio_bounds=(0.5, 3.5))
    close(w, [[0.0, 0.0, 0.0], [1.5, 1.5, 0.0], [0.0, 0.0, 0.0]])  # row 0 (ratio 4) rejected
    np.testing.assert_array_equal(np.asarray(keep),
                                  [[False] * 3, [True, True, False], [False] * 3])
    close(m[p + "rollout_is_oob_ratio"], 3 / 5)
    close(m[p + "rollout_is_seq_masked_fraction"], 1 / 2)


def test_tis_weights_carry_no_gradient():
    dense, sampler = _tis_inputs(TOKEN_RATIOS)
    mask = jnp.array(TIS_MASK)
    c = jnp.arange(6.0).reshape(2, 3) + 1.0
    for level in ("token", "sequence"):
        def f(d, s):
            w, _ = tis_weights(d, s, mask, cap=None, level=level)  # no cap: exp would have a gradient
            return jnp.sum(w * c)
        gd, gs = jax.grad(f, argnums=(0, 1))(dense, sampler)
        close(gd, np.zeros((2, 3)))
        close(gs, np.zeros((2, 3)))


def test_tis_then_loss_jit():
    dense, sampler = _tis_inputs(TOKEN_RATIOS)
    logp, logp_old, adv = _arrays()
    mask = jnp.array(TIS_MASK)

    @jax.jit
    def step(lp, lo, a, d, s, mk):
        w, keep, _ = tis_weights_and_keep(d, s, mk, cap=3.0, mask_ratio_bounds=(0.2, 5.0))
        return policy_loss(lp, lo, a, mk * keep, dual_clip_c=3.0, is_weights=w)[0]

    # Kept tokens: all of row 0 and (1,0); weights [0.25, 2, 3] and [1].
    want = (0.25 * -1.28 + 2.0 * -1.1 + 3.0 * -0.5 + 1.0 * 0.8) / 4
    close(step(logp, logp_old, adv, dense, sampler, mask), want)


# ----------------------------------------------------------------------------- agg_loss
def test_agg_loss_modes_ragged_and_empty_rows():
    values = jnp.array([[1.0, 2.0, 3.0], [4.0, jnp.nan, 6.0], [7.0, 8.0, 9.0]])
    mask = jnp.array([[1, 1, 0], [1, 0, 0], [0, 0, 0]])  # row 2 fully masked (excluded)
    close(agg_loss(values, mask, "token-mean"), (1 + 2 + 4) / 3)
    close(agg_loss(values, mask, "seq-mean-token-mean"), ((1 + 2) / 2 + 4 / 1) / 2)
    close(agg_loss(values, mask, "seq-mean-token-sum"), ((1 + 2) + 4) / 2)
    close(agg_loss(values, mask, "seq-mean-token-sum-norm"), ((1 + 2) + 4) / 2 / 3)
    close(agg_loss(values, mask, "seq-mean-token-sum-norm", loss_scale_factor=10), 3.5 / 10)
    for mode in ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum"):
        close(agg_loss(values, jnp.zeros((3, 3)), mode), 0.0)  # empty mask: 0, not NaN


# ----------------------------------------------------------------------------- KL + grpo_loss
def test_kl_penalty_kinds_and_clamp():
    lp = jnp.array([[-1.0, -2.0, -0.5]])
    ref = jnp.array([[-1.5, -1.0, -31.0]])
    pairs = [(-1.0, -1.5), (-2.0, -1.0), (-0.5, -31.0)]
    close(kl_penalty(lp, ref, "k1"), [[a - b for a, b in pairs]])
    close(kl_penalty(lp, ref, "k2"), [[0.5 * (a - b) ** 2 for a, b in pairs]])
    k3 = []
    for a, b in pairs:
        d = min(max(b - a, -20.0), 20.0)
        k3.append(min(max(math.exp(d) - d - 1.0, -10.0), 10.0))
    close(kl_penalty(lp, ref, "k3"), [k3])
    close(kl_penalty(lp, ref, "low_var_kl"), [k3])  # verl alias
    # ref - logp = -30.5 is clamped to -20: exp(-20) + 20 - 1 = 19.000... -> clamped to 10.
    close(kl_penalty(lp, ref, "k3")[0, 2], 10.0)


def test_grpo_loss_combines_terms():
    logp, logp_old, adv = _arrays()
    mask = jnp.array([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    ref = logp_old - 0.1
    ent = jnp.array([[0.3, 0.6, 9.0], [0.9, 1.2, 1.5]])
    loss, m = grpo_loss(logp, logp_old, adv, mask, dual_clip_c=3.0, logp_ref=ref, kl_coef=0.05,
                        entropy=ent, entropy_coef=0.01)
    pg = (-1.28 - 1.1 + 0.8 + 1.2 + 3.0) / 5
    kept = [(0, 0), (0, 1), (1, 0), (1, 1), (1, 2)]
    k3 = []
    for i, j in kept:
        d = LOGP_OLD[i][j] - 0.1 - LOGP[i][j]
        k3.append(math.exp(d) - d - 1.0)
    kl = sum(k3) / 5
    ent_mean = (0.3 + 0.6 + 0.9 + 1.2 + 1.5) / 5
    close(loss, pg + 0.05 * kl - 0.01 * ent_mean)
    close(m["actor/pg_loss"], pg)
    close(m["actor/kl_loss"], kl)
    close(m["actor/entropy"], ent_mean)
    close(m["actor/kl_coef"], 0.05)
    # Sparrow's released setting: no KL, no entropy -> just the policy term.
    close(grpo_loss(logp, logp_old, adv, mask, dual_clip_c=3.0)[0], pg)


# ----------------------------------------------------------------------------- bad inputs
def test_bad_inputs_raise():
    logp, logp_old, adv = _arrays()
    mask = jnp.ones((2, 3))
    with pytest.raises(ValueError, match="agg must be one of"):
        policy_loss(logp, logp_old, adv, mask, agg="token-sum-mean")
    with pytest.raises(ValueError, match="mode must be one of"):
        agg_loss(logp, mask, "seq-mean")
    with pytest.raises(ValueError, match="level must be one of"):
        tis_weights(logp, logp_old, mask, level="tok")
    with pytest.raises(ValueError, match="kind must be one of"):
        kl_penalty(logp, logp_old, "k4")
    with pytest.raises(ValueError, match="kl_kind must be one of"):
        grpo_loss(logp, logp_old, adv, mask, logp_ref=logp_old, kl_kind="k5")
    with pytest.raises(ValueError, match="advantages must have shape"):
        policy_loss(logp, logp_old, jnp.ones(3), mask)
    with pytest.raises(ValueError, match="logp_old has shape"):
        policy_loss(logp, logp_old[:, :2], adv, mask)
    with pytest.raises(ValueError, match="mask has shape"):
        policy_loss(logp, logp_old, adv, jnp.ones((2, 4)))
    with pytest.raises(ValueError, match="2-D"):
        policy_loss(logp[0], logp_old[0], adv, mask[0])
    with pytest.raises(ValueError, match="dual_clip_c must be > 1"):
        policy_loss(logp, logp_old, adv, mask, dual_clip_c=1.0)
    with pytest.raises(ValueError, match="clip_low"):
        policy_loss(logp, logp_old, adv, mask, clip_low=1.2)
    with pytest.raises(ValueError, match="cap must be > 0"):
        tis_weights(logp, logp_old, mask, cap=0.0)
    with pytest.raises(ValueError, match="0 <= lo < hi"):
        tis_weights(logp, logp_old, mask, mask_ratio_bounds=(2.0, 0.5))
    with pytest.raises(ValueError, match="logp_sampler has shape"):
        tis_weights(logp, logp_old[:1], mask)
    with pytest.raises(ValueError, match="needs logp_ref"):
        grpo_loss(logp, logp_old, adv, mask, kl_coef=0.1)
    with pytest.raises(ValueError, match="needs entropy"):
        grpo_loss(logp, logp_old, adv, mask, entropy_coef=0.1)


# ----------------------------------------------------------------------------- verl cross-checks
# Hand-made inputs with ratios != 1 everywhere; expected values from verl's formulas
# (core_algos.compute_policy_loss_vanilla / agg_loss / kl_penalty, rollout_corr_helper) in numpy.
V_LOGP_OLD = np.array([[-1.0, -0.7, -2.0, -0.4], [-0.3, -1.2, -0.9, -1.5], [-2.2, -0.1, -0.6, -1.1]])
V_LOG_RATIO = np.array([[0.4, -0.1, -0.5, 0.05], [-0.6, 0.15, 1.9, -0.02], [0.3, -0.3, 0.1, 0.2]])
V_LOGP = V_LOGP_OLD + V_LOG_RATIO
V_ADV = np.array([1.5, -0.8, 0.6])
V_MASK = np.array([[1, 1, 1, 0], [1, 1, 1, 1], [0, 0, 0, 0]], np.float32)  # ragged + one empty row
V_W = np.array([[1.0, 0.5, 2.0, 1.0], [1.5, 1.0, 0.25, 3.0], [1.0, 1.0, 1.0, 1.0]])


def _verl_agg(values, mask, mode, global_rows, scale=None):
    if mode == "token-mean":
        return (values * mask).sum() / mask.sum()
    rows = mask.sum(axis=1)
    seq = (values * mask).sum(axis=1)
    if mode == "seq-mean-token-mean":
        seq = np.where(rows > 0, seq / np.maximum(rows, 1), 0.0)
    n = mask.shape[0] if global_rows else (rows > 0).sum()
    loss = seq[rows > 0].sum() / n
    return loss / (scale or mask.shape[1]) if mode == "seq-mean-token-sum-norm" else loss


def _verl_pg(logp, logp_old, adv, clip_low, clip_high, clip_c):
    ratio = np.exp(logp - logp_old)
    a = adv[:, None]
    pg1, pg2 = -a * ratio, -a * np.clip(ratio, 1 - clip_low, 1 + clip_high)
    clip1 = np.maximum(pg1, pg2)
    pg3 = -a * clip_c
    pg = np.where(a < 0, np.minimum(pg3, clip1), clip1)
    return pg, pg2 > pg1, (clip1 > pg3) & (a < 0)


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
@pytest.mark.parametrize("global_rows", [False, True])
def test_verl_policy_loss_every_mode_dual_clip_and_weights(mode, global_rows):
    pg, clipped, lower = _verl_pg(V_LOGP, V_LOGP_OLD, V_ADV, 0.2, 0.28, 3.0)
    want = _verl_agg(pg * V_W, V_MASK, mode, global_rows)
    loss, m = policy_loss(jnp.array(V_LOGP), jnp.array(V_LOGP_OLD), jnp.array(V_ADV), jnp.array(V_MASK),
                          0.2, 0.28, dual_clip_c=3.0, is_weights=jnp.array(V_W), agg=mode, global_rows=global_rows)
    close(loss, want)
    valid = V_MASK > 0
    close(m["actor/pg_clipfrac"], clipped[valid].mean())
    close(m["actor/pg_clipfrac_lower"], lower[valid].mean())
    close(m["actor/ppo_kl"], -V_LOG_RATIO[valid].mean())
    assert clipped[valid].any() and lower[valid].any()  # the inputs reach both clip branches
    if mode == "token-mean":  # d loss / d logp = -A r w / N on unclipped tokens, 0 on clipped ones
        g = jax.grad(lambda lp: policy_loss(lp, jnp.array(V_LOGP_OLD), jnp.array(V_ADV), jnp.array(V_MASK),
                                            0.2, 0.28, 3.0, jnp.array(V_W), mode)[0])(jnp.array(V_LOGP))
        active = valid & ~clipped & ~lower
        close(g, np.where(active, -V_ADV[:, None] * np.exp(V_LOG_RATIO) * V_W, 0.0) / V_MASK.sum())


def test_global_rows_differs_only_with_empty_rows():
    values = jnp.array(V_LOG_RATIO)
    full = jnp.ones_like(values)
    close(agg_loss(values, full, "seq-mean-token-mean", global_rows=True),
          agg_loss(values, full, "seq-mean-token-mean"))
    close(agg_loss(values, jnp.array(V_MASK), "seq-mean-token-sum", global_rows=True),
          agg_loss(values, jnp.array(V_MASK), "seq-mean-token-sum") * 2 / 3)


def test_verl_kl_kinds():
    logp = np.array([[-1.0, -0.5, -30.0], [-2.0, -0.01, -0.2]])
    ref = np.array([[-1.3, -0.5, -0.1], [-0.2, -3.0, -0.25]])
    d = ref - logp
    want = {"k1": logp - ref, "k2": 0.5 * (logp - ref) ** 2,
            "k3": np.clip(np.exp(np.clip(d, -20, 20)) - np.clip(d, -20, 20) - 1, -10, 10)}
    assert want["k3"][0, 2] == 10.0  # the low_var_kl clamp is reached
    for kind, expected in want.items():
        close(kl_penalty(jnp.array(logp), jnp.array(ref), kind), expected)


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_verl_tis_weights_and_upper_bound_fraction(level):
    logp_sampler = V_LOGP_OLD - V_LOG_RATIO  # ratio p_old / p_sampler = exp(V_LOG_RATIO)
    valid = V_MASK > 0
    if level == "token":
        raw = np.exp(V_LOG_RATIO)
        units = raw[valid]
    else:
        raw = np.broadcast_to(np.exp((V_LOG_RATIO * V_MASK).sum(axis=1))[:, None], V_MASK.shape)
        units = raw[valid.any(axis=1), 0]
    w, m = tis_weights(jnp.array(V_LOGP_OLD), jnp.array(logp_sampler), jnp.array(V_MASK), cap=2.0, level=level)
    close(w, np.where(valid, np.minimum(raw, 2.0), 0.0))
    close(m["rollout_corr/rollout_is_ratio_fraction_high"], (units > 2.0).mean())
    # with masking bounds the high fraction counts what the upper bound rejects (cap 10: nothing capped)
    lo, hi = 0.8, 1.3
    w, keep, m = tis_weights_and_keep(jnp.array(V_LOGP_OLD), jnp.array(logp_sampler), jnp.array(V_MASK), cap=10.0,
                                      level=level, mask_ratio_bounds=(lo, hi))
    inside = valid & (raw >= lo) & (raw <= hi)
    np.testing.assert_array_equal(np.asarray(keep), inside)
    close(w, np.where(inside, raw, 0.0))
    close(m["rollout_corr/rollout_is_ratio_fraction_high"], (units > hi).mean())
    close(m["rollout_corr/rollout_is_ratio_fraction_low"], (units < lo).mean())
    assert (units > hi).any()


def test_verl_grpo_advantages_numpy():
    r = np.array(REWARDS).reshape(3, 4)
    want = (r - r.mean(axis=1, keepdims=True)) / (r.std(axis=1, ddof=1, keepdims=True) + 1e-6)
    close(group_advantages(jnp.array(REWARDS), 4, "grpo"), want.reshape(-1))


def test_coin_flip_rewards_keep_the_mean_and_replay_with_the_seed():
    from sparrow_jax.rl.advantages import coin_flip_rewards

    real = np.linspace(0.0, 0.6, 4000)  # partial credit, mean 0.3
    flips = coin_flip_rewards(real, (0, 5, 0))
    assert set(np.unique(flips)) == {0.0, 1.0} and flips.dtype == np.float32
    assert abs(flips.mean() - 0.3) < 4 * np.sqrt(0.3 * 0.7 / 4000)  # within 4 binomial standard errors
    np.testing.assert_array_equal(flips, coin_flip_rewards(real, (0, 5, 0)))  # a resumed step draws the same
    assert not np.array_equal(flips, coin_flip_rewards(real, (0, 6, 0)))
    assert np.corrcoef(flips, real)[0, 1] < 0.1  # no information about which row earned its reward
    assert coin_flip_rewards(np.zeros(8), (1,)).sum() == 0
