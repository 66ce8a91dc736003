"""Synthetic long-context tasks with exact verifiers. Each module exposes
``generate(n, seed, context_tokens, hops, ...) -> list[dict]`` (prompt, reference, answer, meta)
and ``score(completion, example) -> float``."""
from sparrow_jax.data.tasks import pointer_chase, pointer_trace, recurrence_trace

__all__ = ["pointer_chase", "pointer_trace", "recurrence_trace"]
