"""RL objective: group advantages, GRPO/PPO-clip policy loss, truncated importance sampling."""
from sparrow_jax.rl.advantages import ADVANTAGE_MODES, group_advantages
from sparrow_jax.rl.losses import (IS_LEVELS, KL_KINDS, LOSS_AGG_MODES, agg_loss, grpo_loss,
                                   kl_penalty, policy_loss, tis_weights, tis_weights_and_keep)

__all__ = [
    "ADVANTAGE_MODES", "IS_LEVELS", "KL_KINDS", "LOSS_AGG_MODES",
    "agg_loss", "group_advantages", "grpo_loss", "kl_penalty", "policy_loss",
    "tis_weights", "tis_weights_and_keep",
]
