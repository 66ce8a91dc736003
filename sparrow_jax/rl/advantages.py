"""Group-relative advantages for outcome rewards (GRPO and Dr.GRPO), per completion or per token.

Follows verl ``compute_grpo_outcome_advantage`` (``norm_adv_by_std_in_grpo`` True for
"grpo", False for "drgrpo"): the rewards of the ``group_size`` completions sampled for one
prompt are centred on their group mean and, for GRPO, divided by ``std + eps``.

The std is the *unbiased* sample std (ddof=1), as verl uses ``torch.std`` (and TRL's
GRPOTrainer does too). A group of one completion gets mean 0 and std 1, as in verl
(``torch.std`` of one element would be NaN).

Rewards are laid out group-major: row ``i`` belongs to group ``i // group_size``, i.e. the
``group_size`` samples of a prompt are contiguous (what a rollout with ``n`` samples per
prompt produces).

:func:`prefix_advantages` gives each token its own baseline: the mean reward of the group's
completions that share the token's prefix (a group's samples form a tree rooted at the prompt).
Completions on one prefix are in the same state, so the baseline is a value estimate of that state;
a token all of them share then gets advantages that sum to zero over the group (no net update), and
the update concentrates on the tokens where the group's samples part.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

ADVANTAGE_MODES = ("grpo", "drgrpo")
ADVANTAGE_BASELINES = ("group", "prefix")
VETO_BASELINES = ("kept", "all")


def group_advantages(rewards: jax.Array, group_size: int, mode: str = "grpo",
                     eps: float = 1e-6, keep=None, veto_baseline: str = "kept") -> jax.Array:
    """Per-completion advantage from per-completion scalar rewards.

    Args:
      rewards: [N] float, one scalar reward per completion, group-major.
      group_size: completions per prompt G (static int >= 1); N must be a multiple of G.
      mode: "grpo" -> (r - mean_g) / (std_g + eps); "drgrpo" -> r - mean_g (no std).
      eps: added to the std (GRPO only), as verl's ``epsilon``.
      keep: optional bool [N], the rows that stay in the update (``train.tis_veto`` rejects the
        others). A group's mean and std are then those of its kept rows; rejected rows get 0, and
        so does every row of a group with fewer than 2 kept rows (nothing to compare with), except
        at ``group_size`` 1, where a kept row gets verl's lone-sample advantage.
      veto_baseline: with ``keep``, "kept" (above) or "all": each group's mean and std are over all
        of its rows, as without the veto, and only the rejected rows' advantages are zeroed, so a
        group with one kept row still gives it a comparison.

    Returns:
      [N] advantages in the dtype of ``rewards`` (float32 for integer rewards). Carry no
      gradient (advantages are constants of the policy loss).
    """
    if mode not in ADVANTAGE_MODES:
        raise ValueError(f"group_advantages: mode must be one of {ADVANTAGE_MODES}, got {mode!r}")
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1:
        raise ValueError(f"group_advantages: group_size must be an int >= 1, got {group_size!r}")
    rewards = jnp.asarray(rewards)
    if rewards.ndim != 1:
        raise ValueError(f"group_advantages: rewards must be 1-D [N], got shape {rewards.shape}")
    n = rewards.shape[0]
    if n % group_size != 0:
        raise ValueError(f"group_advantages: number of rewards N={n} is not a multiple of "
                         f"group_size={group_size} (expected N % group_size == 0)")
    if not jnp.issubdtype(rewards.dtype, jnp.floating):
        rewards = rewards.astype(jnp.float32)
    rewards = jax.lax.stop_gradient(rewards)
    r = rewards.reshape(n // group_size, group_size)
    if veto_baseline not in VETO_BASELINES:
        raise ValueError(f"group_advantages: veto_baseline must be one of {VETO_BASELINES}, got {veto_baseline!r}")
    if keep is not None and veto_baseline == "all":
        keep = jnp.asarray(keep, bool)
        if keep.shape != (n,):
            raise ValueError(f"group_advantages: keep must be bool [N] = [{n}], got shape {keep.shape}")
        return jnp.where(keep, group_advantages(rewards, group_size, mode, eps), 0.0).astype(rewards.dtype)
    if keep is not None:
        return _kept_group_advantages(r, jnp.asarray(keep, bool), mode, eps).reshape(n).astype(rewards.dtype)
    if group_size == 1:
        # verl: a lone sample has mean 0, std 1 (no baseline to compare with).
        mean = jnp.zeros_like(r[:, :1])
        std = jnp.ones_like(r[:, :1])
    else:
        mean = jnp.mean(r, axis=1, keepdims=True)
        std = jnp.std(r, axis=1, keepdims=True, ddof=1)
    if mode == "grpo":
        adv = (r - mean) / (std + eps)
    else:
        adv = r - mean
    return adv.reshape(n).astype(rewards.dtype)


def _kept_group_advantages(r: jax.Array, keep: jax.Array, mode: str, eps: float) -> jax.Array:
    """:func:`group_advantages` over each group's kept rows. r [P, G] rewards, keep bool [P * G] -> [P, G]."""
    if keep.shape != (r.size,):
        raise ValueError(f"group_advantages: keep must be bool [N] = [{r.size}], got shape {keep.shape}")
    k = keep.reshape(r.shape)
    if r.shape[1] == 1:  # verl's lone sample: mean 0, std 1
        return jnp.where(k, r, 0.0)
    kf = k.astype(r.dtype)
    count = kf.sum(axis=1, keepdims=True)
    mean = (r * kf).sum(axis=1, keepdims=True) / jnp.maximum(count, 1.0)
    centred = (r - mean) * kf
    if mode == "grpo":  # ddof=1 over the kept rows, as the whole-group std
        std = jnp.sqrt((centred ** 2).sum(axis=1, keepdims=True) / jnp.maximum(count - 1.0, 1.0))
        centred = centred / (std + eps)
    return jnp.where(k & (count >= 2), centred, 0.0)


def prefix_advantages(rewards: np.ndarray, tokens: np.ndarray, mask: np.ndarray, group_size: int,
                      mode: str = "grpo", eps: float = 1e-6) -> np.ndarray:
    """Per-token advantages [N, T] whose baseline is the mean reward of the group's rows sharing the prefix.

    Row i's token t gets ``(r_i - mean{r_k : row k of i's group has tokens[k, :t] == tokens[i, :t]})``,
    divided by the group's reward std + eps (ddof=1) for "grpo" (the same scale as
    :func:`group_advantages`, whose advantages these equal at a group's first completion token), not
    for "drgrpo". Row i always shares its own prefix, so a row alone on its prefix gets 0 there: its
    tokens past the group's last parting carry no comparison.

    Args:
      rewards: [N] float, one reward per row, group-major (rows ``g * G .. g * G + G - 1`` one prompt).
      tokens: [N, T] int, prompt and completion tokens; the rows of a group share their prompt, so
        their positions align.
      mask: [N, T] the completion tokens (0 elsewhere; the result is 0 there).
      group_size: G >= 1; N must be a multiple of G.
    """
    rewards, tokens, mask = np.asarray(rewards, np.float32), np.asarray(tokens), np.asarray(mask)
    if mode not in ADVANTAGE_MODES:
        raise ValueError(f"prefix_advantages: mode must be one of {ADVANTAGE_MODES}, got {mode!r}")
    n = rewards.shape[0]
    if rewards.ndim != 1 or tokens.ndim != 2 or tokens.shape[0] != n or mask.shape != tokens.shape:
        raise ValueError(f"prefix_advantages: need rewards [N], tokens [N, T] and mask [N, T]; got "
                         f"{rewards.shape}, {tokens.shape}, {mask.shape}")
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1 or n % group_size:
        raise ValueError(f"prefix_advantages: group_size must be an int >= 1 dividing N={n}, got {group_size!r}")
    g, t = group_size, tokens.shape[1]
    r = rewards.reshape(-1, g)
    adv = np.zeros((n // g, g, t), np.float32)
    for p, tok in enumerate(tokens.reshape(-1, g, t)):  # one group at a time: [G, G, T] booleans
        differ = tok[:, None, :] != tok[None, :, :]
        # first position where rows i and k differ (T where they never do): k shares i's prefix at t <= it
        parting = np.where(differ.any(-1), differ.argmax(-1), t)  # [G(i), G(k)]
        shares = np.arange(t)[None, None, :] <= parting[..., None]  # [G(i), G(k), T]
        adv[p] = r[p, :, None] - (shares * r[p, None, :, None]).sum(1) / shares.sum(1)
    if mode == "grpo":
        std = r.std(axis=1, ddof=1, keepdims=True) if g > 1 else np.ones_like(r[:, :1])
        adv = adv / (std[:, :, None] + eps)
    return (adv.reshape(n, t) * (mask > 0)).astype(np.float32)


def coin_flip_rewards(rewards: np.ndarray, seed: tuple[int, ...]) -> np.ndarray:
    """float32 [N]: the random-reward control's rewards, 0/1 coin flips with the batch's mean reward.

    A held-out gain from training on these is not from the reward (it comes from the update itself:
    sharpening, length drift). The flips keep the real rewards' mean, so the update's scale and the
    share of groups with a signal stay comparable; ``seed`` (e.g. (run seed, step, first row)) makes a
    resumed run draw the same flips.
    """
    p = float(np.clip(np.mean(rewards), 0.0, 1.0)) if len(rewards) else 0.0
    return (np.random.default_rng(seed).random(len(rewards)) < p).astype(np.float32)
