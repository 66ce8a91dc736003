"""Group-relative advantages for outcome rewards (GRPO and Dr.GRPO).

Follows verl ``compute_grpo_outcome_advantage`` (``norm_adv_by_std_in_grpo`` True for
"grpo", False for "drgrpo"): the rewards of the ``group_size`` completions sampled for one
prompt are centred on their group mean and, for GRPO, divided by ``std + eps``.

The std is the *unbiased* sample std (ddof=1), as verl uses ``torch.std`` (and TRL's
GRPOTrainer does too). A group of one completion gets mean 0 and std 1, as in verl
(``torch.std`` of one element would be NaN).

Rewards are laid out group-major: row ``i`` belongs to group ``i // group_size``, i.e. the
``group_size`` samples of a prompt are contiguous (what a rollout with ``n`` samples per
prompt produces).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

ADVANTAGE_MODES = ("grpo", "drgrpo")


def group_advantages(rewards: jax.Array, group_size: int, mode: str = "grpo",
                     eps: float = 1e-6) -> jax.Array:
    """Per-completion advantage from per-completion scalar rewards.

    Args:
      rewards: [N] float, one scalar reward per completion, group-major.
      group_size: completions per prompt G (static int >= 1); N must be a multiple of G.
      mode: "grpo" -> (r - mean_g) / (std_g + eps); "drgrpo" -> r - mean_g (no std).
      eps: added to the std (GRPO only), as verl's ``epsilon``.

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


def coin_flip_rewards(rewards: np.ndarray, seed: tuple[int, ...]) -> np.ndarray:
    """float32 [N]: the random-reward control's rewards, 0/1 coin flips with the batch's mean reward.

    A held-out gain from training on these is not from the reward (it comes from the update itself:
    sharpening, length drift). The flips keep the real rewards' mean, so the update's scale and the
    share of groups with a signal stay comparable; ``seed`` (e.g. (run seed, step, first row)) makes a
    resumed run draw the same flips.
    """
    p = float(np.clip(np.mean(rewards), 0.0, 1.0)) if len(rewards) else 0.0
    return (np.random.default_rng(seed).random(len(rewards)) < p).astype(np.float32)
