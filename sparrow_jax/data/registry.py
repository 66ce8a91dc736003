"""Task registry: a task name -> how to format its prompts, how to score completions, how to
generate examples (synthetic tasks only).

Built-ins: ``"pointer_chase"`` (synthetic, cheap in-process verifier; one short answer),
``"pointer_chase_partial"`` (the same with partial credit for untrained models),
``"pointer_trace"`` (the same prompts, the answer a long trace of every hop, partial credit),
``"recurrence_trace"`` (a long trace of local steps with a share of far look-ups, partial credit) and ``"math"`` (prompts
from a dataset, math-verify reward; run it through ``RewardPool`` so a pathological answer
cannot hang training).
"""
from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, Callable

from sparrow_jax.data import rewards
from sparrow_jax.data.tasks import pointer_chase, pointer_trace, recurrence_trace

if TYPE_CHECKING:
    from sparrow_jax.models.tokenizer import Tokenizer

PromptFn = Callable[[dict, "Tokenizer"], str]      # (example, tokenizer) -> model input text
RewardFn = Callable[[str, dict], float]            # (completion, example) -> reward
GenerateFn = Callable[..., list]                   # (n, seed, **knobs) -> list[example]
HorizonFn = Callable[[str, dict], "int | None"]    # (completion, example) -> characters deciding the reward


@dataclasses.dataclass(frozen=True)
class Task:
    """``format_prompt(example, tokenizer)`` -> the text to encode; ``reward(completion, example)``
    -> float; ``generate(n, seed, **knobs)`` or None for dataset-backed tasks.
    ``use_reward_pool``: run ``reward`` in a ``RewardPool`` (slow / unbounded verifiers).
    ``reward_horizon(completion, example)`` -> the characters of the completion that decide its
    reward (None: all), for rewards that ignore what follows a first error; None: not defined."""

    name: str
    format_prompt: PromptFn
    reward: RewardFn
    generate: GenerateFn | None = None
    use_reward_pool: bool = False
    reward_pool_initializer: Callable[[], None] | None = None
    reward_horizon: HorizonFn | None = None


_TASKS: dict[str, Task] = {}


def register_task(name: str, format_prompt: PromptFn, reward: RewardFn, generate: GenerateFn | None = None,
                  *, use_reward_pool: bool = False, reward_pool_initializer: Callable[[], None] | None = None,
                  reward_horizon: HorizonFn | None = None, overwrite: bool = False) -> Task:
    """Register a task under ``name`` (error if taken, unless ``overwrite``)."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"register_task: name must be a non-empty str, got {name!r}")
    if name in _TASKS and not overwrite:
        raise ValueError(f"register_task: task {name!r} is already registered (pass overwrite=True)")
    for field, fn in (("format_prompt", format_prompt), ("reward", reward)):
        if not callable(fn):
            raise TypeError(f"register_task({name!r}): {field} must be callable, got {type(fn).__name__}")
    task = Task(name, format_prompt, reward, generate, use_reward_pool, reward_pool_initializer, reward_horizon)
    _TASKS[name] = task
    return task


def get_task(name: str) -> Task:
    if name not in _TASKS:
        raise KeyError(f"unknown task {name!r}; known tasks: {sorted(_TASKS)}")
    return _TASKS[name]


def list_tasks() -> list[str]:
    return sorted(_TASKS)


def chat_prompt(content: str, tokenizer: "Tokenizer", **template_kwargs: Any) -> str:
    """One user message through the tokenizer's chat template, generation prompt added."""
    return tokenizer.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True,
                                         **template_kwargs)


def pointer_chase_prompt(example: dict, tokenizer: "Tokenizer") -> str:
    """Builtin tokenizer (no ``chat_template`` attribute): the raw prompt, which tiny models learn
    from SFT. A real model's tokenizer: an instruction + the prompt, as a chat turn when the
    tokenizer has a template, as plain text otherwise."""
    if not hasattr(tokenizer, "chat_template"):
        return chat_prompt(example["prompt"], tokenizer)
    text = POINTER_CHASE_INSTRUCTION + example["prompt"]
    return text if tokenizer.chat_template is None else chat_prompt(text, tokenizer)


POINTER_CHASE_INSTRUCTION = (
    "Each record below is key=value; every value is also a key. Starting at the start key, follow the "
    "given number of hops: write each hop as n:key=value on its own line, then 'answer: ' and the last "
    "value.\n\n")

RECURRENCE_TRACE_INSTRUCTION = (
    "Write numbered lines from the start digits: each line is the sum mod 10 of the two before it, except "
    "every line whose number is a multiple of the look-up period, which writes the key spelled by the two "
    "previous digits (0-9 as a-j, newest first) and that key's constant from the table. Stop after the "
    "look-up that reads #.\n\n")


def recurrence_trace_prompt(example: dict, tokenizer: "Tokenizer") -> str:
    """As :func:`pointer_chase_prompt`, with this task's instruction for real tokenizers."""
    if not hasattr(tokenizer, "chat_template"):
        return chat_prompt(example["prompt"], tokenizer)
    text = RECURRENCE_TRACE_INSTRUCTION + example["prompt"]
    return text if tokenizer.chat_template is None else chat_prompt(text, tokenizer)


MATH_TEMPLATE = "{problem}\nPlease reason step by step, and put your final answer within \\boxed{{}}."


def math_prompt(example: dict, tokenizer: "Tokenizer") -> str:
    """``example['prompt']`` through the chat template, generation prompt added: a problem string
    with the \\boxed{} instruction as a user turn, or chat messages (verl's preprocessed schema,
    whose own instruction must ask for a \\boxed{} answer: the reward reads the last one) as they are."""
    prompt = example["prompt"]
    if isinstance(prompt, (list, tuple)):
        return tokenizer.apply_chat_template(list(prompt), add_generation_prompt=True)
    return chat_prompt(MATH_TEMPLATE.format(problem=prompt), tokenizer)


def pointer_chase_partial_score(completion: str, example: dict) -> float:
    """1.0 for the right answer, else half the symbol overlap with the reference chain: a reward
    that untrained (random) models already vary on, so smoke runs have a learning signal."""
    if pointer_chase.score(completion, example):
        return 1.0
    return 0.5 * rewards.symbol_overlap_credit(rewards.before_eos(completion), example["reference"])


register_task("pointer_chase", pointer_chase_prompt, pointer_chase.score, pointer_chase.generate)
register_task("pointer_chase_partial", pointer_chase_prompt, pointer_chase_partial_score, pointer_chase.generate)
register_task("pointer_trace", pointer_chase_prompt, pointer_trace.score, pointer_trace.generate)
register_task("recurrence_trace", recurrence_trace_prompt, recurrence_trace.score, recurrence_trace.generate,
              reward_horizon=recurrence_trace.reward_horizon)
register_task("math", math_prompt, rewards.math_reward_fn, None, use_reward_pool=True,
              reward_pool_initializer=rewards.warm_math_verify)
