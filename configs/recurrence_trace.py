"""Mostly-local long traces on a 3-layer tiny Qwen3 (every layer sparse): task recurrence_trace,
a 636-token prompt (a table of 126 two-letter constants) and a trace of >= 240 numbered lines
(~1.3K generated tokens), most lines the recurrence v[i] = (v[i-1] + v[i-2]) mod 10 of the last
two lines, every 10th a look-up of one constant anywhere in the table.

    python -m experiments.warmup --config configs/recurrence_trace.py      # the warm-up (+ reward by trace length)
    python -m experiments.calibrate --config configs/recurrence_trace.py   # budget x bin -> p5 -> schedule
    python -m experiments.run --config configs/recurrence_trace.py         # warm-up, calibration, GRPO, report

Every prompt is 636 tokens (126 entries of 5 tokens + the start line), so position bins of 159
(636 = 4 x 159) are bins of generated positions: 0-158, 159-317, ... of each trace.

Measured warm-up (docs/results.md, "A warm-up on recurrence_trace"; 2-core CPU under load, 39
min): dense greedy reward 0.48 at 20 lines, 0.13 at 80, 0.07 at 160, 0.04 at 240, i.e. the first
~10 lines right and the first look-up against the whole table wrong. That is below the 0.2-0.5 at
the RL length the study needs: the warm-up does not yet learn look-ups against the whole table
(a variant with 350 whole-table steps did not either; see the same section). Stages with a
look-up every 2nd line (``lookup_every``, a stage's 5th element) learn it on 6-entry tables (93%
teacher-forced after 800 steps) but, so far, not its carry-over to the whole table at the
task's rate (same section).
"""
from ml_collections import ConfigDict

from configs.long_trace import get_config as long_trace_config


def get_config():
    c = long_trace_config()
    c.workdir = "runs/recurrence_trace"
    c.model.tiny = ConfigDict(dict(  # vocabulary: the builtin tokenizer's (111)
        hidden_size=128, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
        head_dim=32, intermediate_size=256, tie_word_embeddings=True, rope_theta=10000.0,
        max_position_embeddings=4096))
    # Warm-up SFT (sparrow_jax.sft.settings.WarmupSettings; for this task a curriculum stage's
    # max_context caps the table in tokens, pruned to the keys the trace reads plus others, and
    # max_hops caps the trace's min_lines): short traces over a handful of records first, then
    # longer traces and the whole table. A stage's tables are uniform in [min_context, max_context]
    # tokens, so the 640-token stages see the whole table only at the top of that range.
    c.model.warmup = ConfigDict(dict(
        steps=900, batch_size=32, lr=3e-3, min_context=5, max_train_context=640, max_train_hops=240,
        queries_per_example=1, prompt_weight=0.0, final_frac=0.0, final_batch_size=2, seed=0,
        lookup_every=0, lookup_weight=0.0,
        curriculum=((400, 5, 14, 32), (150, 60, 30, 24), (150, 200, 60, 12), (100, 640, 120, 6), (100, 640, 240, 3)),
        cache_dir="runs/cache", eval_lengths=(650,), eval_hops=(20, 80, 160, 240), eval_prompts=32))
    c.task.name = "recurrence_trace"
    c.task.context_tokens = 650  # 126 table entries (the 100 read keys + 26 distractors): 636-token prompts
    c.task.min_lines = 240  # the trace ends at the first fresh look-up from line 240 on: ~1.3K tokens
    c.task.far_every = 10  # one line in 10 reads the table
    c.task.gap_tokens = 0
    c.task.hops = 2  # pointer-task knobs: unused by recurrence_trace (common defaults)
    c.task.key_len = 3
    c.task.isolate_chain = False
    c.schedule.bin_width = 159  # prompts of 636 tokens = 4 bins: generated positions in bins of 159
    c.rollout.max_new_tokens = 1480  # ~279 lines (min_lines + 4 look-up periods); longer traces are cut (reward: their prefix)
    c.calibration.budgets = (8, 12, 16, 24, 32, 48)
    return c
