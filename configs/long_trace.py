"""Long generated traces on a 2-layer tiny Qwen3 (both layers sparse): task pointer_trace, a
888-token prompt of records and a completion writing every hop of a 104-hop chain (up to 704
generated tokens, ~1.6K per rollout), each line needing one record from anywhere in the prompt.
configs/quickstart.py is this config with RL cycling 16 training prompts for 24 steps;
configs/long_preamble.py puts an 888-token preamble before its records.

    python -m experiments.warmup --config configs/long_trace.py      # the warm-up alone (+ accuracy by hops)
    python -m experiments.calibrate --config configs/long_trace.py   # budget x bin -> p5 -> schedule
    python -m experiments.run --config configs/long_trace.py         # warm-up, calibration, GRPO, report

The warm-up ships (sparrow_jax/sft/checkpoints/long_trace/, found by its settings' hash), and so
does its main phase (long_trace_base/: the curriculum, which the refine run continues);
``python -m experiments.warmup --config configs/long_trace.py`` without the first retrains only
the refine run (~9 minutes), ``--noshipped`` retrains both (the curriculum is chaotic: retrained
on another machine it can settle elsewhere, hence the shipped files).
Every prompt is 888 tokens, so position bins of 148 (888 = 6 x 148) are bins of generated
positions: 0-147, 148-295, ... of each trace, with no thin bin of the traces' first few tokens
(with bins of 128 the 768 bin held only positions 888-895 of each row). The RL run reports
completion_tokens_mean, sparse_token_fraction, p5_by_bin and the rollout speedup measured in
the run; calibration.json holds the budget x bin table.
"""
from ml_collections import ConfigDict

from configs.common import base_config, warmup_config


def get_config():
    c = base_config()
    c.workdir = "runs/long_trace"
    c.model.source = "warmup"
    c.model.tiny = ConfigDict(dict(  # vocabulary: the builtin tokenizer's (111)
        hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=32, intermediate_size=256, tie_word_embeddings=True, rope_theta=10000.0,
        max_position_embeddings=4096))
    # Warm-up SFT (sparrow_jax.sft.settings.WarmupSettings): a curriculum of growing rows. The lookup
    # emerges only with a handful of records per row (contexts <= 32 tokens, <= 3 hops: reference
    # NLL ~0.15 by step 200, ~0.01 once the values are right); rows then grow 2x per stage so the
    # model keeps it at new positions, and the last 100 steps train on the task's own rows.
    # Rows with tens of records from the start never left the uniform-over-records plateau.
    c.model.warmup = warmup_config()
    c.model.warmup.update(dict(
        steps=1800, batch_size=32, lr=3e-3, min_context=16, max_train_context=80, max_train_hops=8,
        queries_per_example=1, prompt_weight=0.3, final_frac=100 / 1800, final_batch_size=2, seed=0,
        curriculum=((800, 32, 3, 32), (300, 64, 6, 32), (250, 128, 12, 24), (200, 256, 24, 12), (150, 512, 48, 6)),
        # then a warm restart on the task's own 1.6K-token rows (WarmupSettings.refine_steps): the
        # schedule above meets them only at the end of its decay (reference NLL still falling,
        # 0.10; greedy 104-hop reward 0.04), 300 more steps of 4 rows at 1e-3 take it to ~0.005.
        refine_steps=300, refine_lr=1e-3, refine_batch_size=4,
        cache_dir="runs/cache", eval_lengths=(896,), eval_hops=(8, 32, 104), eval_prompts=8))
    c.task.name = "pointer_trace"
    c.task.context_tokens = 896  # ~150 records of 6 tokens
    c.task.hops = 104  # 105 record lines of 6 tokens + the answer: ~635 generated tokens
    c.schedule.page_size = 16
    c.schedule.bin_width = 148  # prompts of 888 tokens = 6 bins: generated positions in bins of 148
    # Falls after 2 steps of evidence at a budget (the minimum for a noise estimate): a run of 12 steps
    # has room for the 3-4 falls a dense start needs to reach the calibrated budgets.
    c.schedule.online.patience = 2
    # A bin far below tau may double its budget in one step (4 grid levels; one level per 0.03 of
    # shortfall): started at 16 pages, rises of at most 2 levels spent 4 steps below tau, and those
    # steps' rollouts cost reward.
    c.schedule.online.up_levels = 4
    # The hysteresis band must exceed what one noisy step reads below a bin's p5: a bin of 500-1000
    # tokens reads its p5 with a spread of ~0.03 step to step (the online quickstart: 0.879, 0.881,
    # 0.894, 0.809 at one budget), and one grid level down costs 0.04-0.06 of p5 (calibration
    # table, bins 1184-1332). With 0.03 a bin fell once its bound passed 0.89 and read 0.809 the
    # next step; with 0.05 it holds until the bound passes 0.91. Rises: one level per 0.05 short.
    c.schedule.online.margin = 0.05
    # A dense start reads p5 ~1.0 at its own contexts' budgets: falls of up to 2 levels when the bound
    # clears tau + margin by another margin (one level at a time, the arm started dense ended 12 steps
    # 21% above the calibrated cost)
    c.schedule.online.down_levels = 2
    c.schedule.dense_layers = ()  # both sparse: layer 0 reads the last tokens (always-kept pages)
    # Quest's per-channel key bounds find the one record a lookup needs; a page's mean key (centroid)
    # blurs it with its neighbours (teacher-forced on reference traces at top-k 32: p5 0.87 vs 0.56).
    c.schedule.selector = "quest"
    c.rollout.max_new_tokens = 704
    c.rollout.temperature = 1.0
    c.calibration.tau = 0.86
    c.calibration.budgets = (16, 24, 32, 48, 64, 80)
    c.calibration.num_prompts = 8
    c.calibration.samples_per_prompt = 2
    c.calibration.validate_prompts = 8
    c.calibration.spread_prompts = False  # every prompt at task.context_tokens: the trace spans the bins
    c.task.key_len = 2  # the warm-up and RL prompts share it
    # A wrong record leads off the chain for good (the trace loops among off-chain records up to
    # the length limit) instead of skipping ahead to the terminal record and ending early.
    c.task.isolate_chain = True
    c.calibration.min_count = 200  # completion tokens a (budget, bin) cell needs to count
    c.schedule.kind = "calibrated"
    c.task.num_train = 256
    c.task.num_eval = 8
    c.rollout.prompts_per_step = 4
    c.rollout.group_size = 4
    c.steps = 12
    c.checkpoint_every = 6
    c.eval_k = 2
    # The refined warm-up is sharp (entropy ~0.04 nats per token): 1e-4 nearly doubled its entropy in
    # 12 steps (0.035 -> 0.065) and p5 fell with it; 3e-5 holds both (0.04-0.067, no trend)
    c.train.learning_rate = 3e-5
    return c
