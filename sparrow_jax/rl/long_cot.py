"""Long-CoT batch shaping (DAPO): overlong reward shaping, truncated-completion masking, length stats.

Pure numpy on the host, between sampling and the train step. A completion is *truncated*
when it reached the token cap without sampling a stop token.
"""
from __future__ import annotations

import numpy as np


def overlong_penalty(completion_lens: np.ndarray, max_new_tokens: int, buffer: int, factor: float) -> np.ndarray:
    """DAPO's soft overlong punishment, added to the task reward. -> float32 [B]

    With L the completion length, cap L_max and buffer L_b:
        0                                  if L <= L_max - L_b
        (L_max - L_b - L) / L_b * factor   if L_max - L_b < L <= L_max   (linear, down to -factor)
    ``buffer == 0`` turns it off (all zeros).
    """
    if not 0 <= buffer < max_new_tokens:
        raise ValueError(f"overlong_penalty: buffer must be in [0, max_new_tokens={max_new_tokens}), got {buffer}")
    lens = np.asarray(completion_lens, np.float32)
    if buffer == 0:
        return np.zeros_like(lens)
    over = np.clip(lens - (max_new_tokens - buffer), 0.0, buffer)
    return (-over / buffer * factor).astype(np.float32)


def truncated(completion_lens: np.ndarray, finished: np.ndarray, max_new_tokens: int) -> np.ndarray:
    """[B] bool: the completion hit ``max_new_tokens`` without a stop token."""
    return (np.asarray(completion_lens) >= max_new_tokens) & ~np.asarray(finished, bool)


def mask_truncated(mask: np.ndarray, is_truncated: np.ndarray) -> np.ndarray:
    """[B, T] loss mask with the rows of truncated completions zeroed (DAPO overlong filtering)."""
    return np.where(np.asarray(is_truncated, bool)[:, None], 0, mask).astype(mask.dtype)


def response_length_metrics(completion_lens: np.ndarray, max_new_tokens: int) -> dict[str, float]:
    """verl's ``response_length/{mean,max,min,clip_ratio}``; clip_ratio: share at the cap."""
    lens = np.asarray(completion_lens, np.float64)
    return {"response_length/mean": float(lens.mean()), "response_length/max": float(lens.max()),
            "response_length/min": float(lens.min()),
            "response_length/clip_ratio": float(np.mean(lens >= max_new_tokens))}
