"""Data: synthetic long-context tasks, prompt datasets, reward functions, the task registry.

Attributes are imported lazily so that spawned reward workers (which import
``sparrow_jax.data.rewards``) do not pay for the rest of the package.
"""
import importlib

_EXPORTS = {
    "load_prompt_dataset": "datasets", "write_task_dataset": "datasets", "read_task_dataset": "datasets",
    "PromptIterator": "datasets",
    "math_reward": "rewards", "math_reward_fn": "rewards", "RewardPool": "rewards", "last_boxed": "rewards",
    "Task": "registry", "register_task": "registry", "get_task": "registry", "list_tasks": "registry",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name):
    if name in _EXPORTS:
        return getattr(importlib.import_module(f"sparrow_jax.data.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module 'sparrow_jax.data' has no attribute {name!r}")
