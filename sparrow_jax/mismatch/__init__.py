"""Actor-policy mismatch: exact per-token measures, teacher-forced scorers, tail statistics.

Public API:
  acceptance_rate(logits_p, logits_q) -> alpha [...]     exact sum_x min(p, q)
  binned_percentile(values, positions, mask, bin_width=2000, q=5.0)
      -> (bin_starts, percentiles, counts)
  score_rollout(config, dense_params, sparse_params, tokens, schedule=...) -> per-token stats
"""
from sparrow_jax.mismatch.measures import (acceptance_rate, acceptance_rate_from_topk, kl_divergence,
                                           mismatch_stats, topk_acceptance_rate, total_variation)
from sparrow_jax.mismatch.scorers import per_token_mismatch, score_rollout
from sparrow_jax.mismatch.tail import TailAccumulator, binned_percentile, binned_percentile_jax, percentile_key
