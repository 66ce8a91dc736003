"""The headline study on recurrence_trace with one-letter keys (90-token prompts: a 20-key table;
~1.4K-token mostly local traces, every 10th line a look-up; the 3-layer tiny Qwen3 with every
layer sparse): does RL with sparse rollouts at the calibrated tau = 0.86 schedule train the dense
policy as well as dense rollouts, does the paper's collapse threshold tau = 0.75 not, and does its
stable threshold 0.92?

    python -m experiments.warmup --config configs/headline.py   # the warm-up alone (+ reward by trace length)
    python -m experiments.run --config configs/headline.py

Arms, each at seeds 0 and 1 with the same prompts (``runs/headline/<arm>/seed_<s>``): dense
rollouts; the schedule calibrated at tau = 0.86 (``runs/headline/schedule.json``); the schedule
calibrated the same way at ``study.low_tau`` = 0.75 (``runs/headline/calibrated_low/``) and at
``study.high_tau`` = 0.92 (``runs/headline/calibrated_high/``), each trained only if its schedule
differs from the tau = 0.86 one (else it is that run, ``same_run_as`` in the report); the online
controller started dense; and the random-reward control (dense
rollouts whose update learns from coin flips with the batch's mean reward: a held-out gain there is
not from the reward).
Resumable arm by arm and seed by seed. Writes ``runs/headline/report.json`` (per arm over seeds:
dense held-out reward start / end / change with standard errors, area under the dense validation
curve, sampled reward, pooled and worst-step per-bin p5, generated tokens per rollout second,
predicted cost, median RL step time vs dense, and the paired rollout speedup of each sparse arm's
final schedule measured after its first seed) and ``headline.png``.

RL: 100 GRPO steps of 32 rollouts (8 prompts x 4) from 1024 training prompts at lr 5e-5, the final
norm at 1000x that rate (``train.lr_scale_params``: it scales every logit, and RL's gain here is
mostly a sharper policy; at 1x the dense arm gained +0.031), the loss ended at each completion's
first wrong line (``train.reward_horizon_mask``: without it no setting tried learned,
docs/results.md) and anchored to the warm-up by verl's low-variance KL at 0.5 (``train.kl_coef``:
without it the random-reward control's updates walk the policy off its sharp optimum); the dense
policy validated densely every 25 steps on 32 held-out prompts x 4 samples; after training, every
arm's final dense policy on 128 held-out prompts, paired (``study.final_eval_prompts``); the update
in 4 row groups cut at the reward horizon (``train.horizon_groups``: the same gradient, 1.84x
faster); the key table's 6 pages always kept (``schedule.reserved_first``) and the sparse actor's
exact statistics on every 4th step (``train.mismatch_every``); each calibrated schedule also keeps
>= 95% of the dense policy's unbroken greedy traces in every bin (``calibration.min_survival``,
``calibration.survival_decoding``). Measured at commit 1d3eeff (docs/results.md; 2 seeds, 78 min on
2 cores by the study's ``wall_s``, each part's time in ``report.json``): dense rollouts raise the
dense held-out reward by 0.103 +- 0.009 and the random-reward control changes it by -0.012 +-
0.009; tau = 0.86, 0.75 and 0.92 derive one schedule, 6 / 12 / 24 / 96 / 96 / 96 pages (the study
trains it once), which lags dense by 0.010 +- 0.008 (pooled p5 >= 0.998 in every bin) at 92% of
the pages (rollouts 1.00x), and by 0.022 +- 0.010 over five seeds (seeds 2-4 run as separate
studies; the bound max(1 SE, 20% of the gain) is 0.020); the online arm lags by 0.075 +- 0.013
(89%). With survival counted on sampled rows (``survival_decoding="sampled"``, commit ba02069) the
tau = 0.86 arm kept 72% of the pages (rollouts 1.26x) and lagged by 0.036 +- 0.015 (0.032 +- 0.008
over five seeds); with p5 alone (``--config.calibration.min_survival=0``, commit bf7ed17) the arms at tau = 0.86 / 0.75 /
0.92 lagged by 0.060 / 0.079 / 0.051.

The warm-up below ships (sparrow_jax/sft/checkpoints/headline; ``--noshipped`` retrains it, ~40
min on 2 cores): a 2200-step dense curriculum, then a 300-step refine on the task's rows whose loss
adds the sparse actor's NLL (every layer sparse, 8 pages). Dense greedy reward on 32 held-out
prompts 0.96 / 0.82 / 0.57 at 60 / 120 / 240 lines; sampled (temperature 1, 4 per prompt) 0.26 at
the RL length. Calibrated at tau = 0.86 with every layer sparse, the table kept, and the survival
rule on greedy traces, the schedule selects 6 / 12 / 24 / 96 / 96 / 96 pages (besides the 6 kept
and the last 2) in the bins from 0 / 256 / ... / 1280 and passes validation on fresh prompts (p5
0.996 or more). Arms that have only the first page kept, as before d15684b:
``--config.schedule.reserved_first=1`` (docs/results.md).
"""
from configs.common import study_config
from configs.recurrence_trace import get_config as recurrence_trace_config


def get_config():
    c = recurrence_trace_config()
    c.workdir = "runs/headline"
    # The task with one-letter keys: a 20-key table (80 tokens; 90-token prompts), a look-up every
    # 10th line, traces ending at the first fresh look-up from line 240 on (~1.4K generated tokens).
    c.task.key_letters = 1
    c.task.context_tokens = 96
    c.task.min_lines = 240
    c.model.warmup.update(dict(
        steps=2200, min_context=96, max_train_context=96, lookup_weight=1.0,
        # look-ups every 2nd line on 6-entry tables until they are learned (the only recipe that
        # learned them so far, docs/results.md), tables grown to the task's 20 entries at that
        # rate, then every 5th line and the task's rate on ever longer traces (min_context=96:
        # every stage's table is exactly its cap, in tokens of 4 an entry)
        curriculum=((800, 24, 12, 32, 2), (300, 48, 24, 32, 2), (300, 96, 30, 32, 2), (300, 96, 60, 16, 5),
                    (300, 96, 120, 8), (200, 96, 240, 4)),
        eval_lengths=(96,), eval_hops=(60, 120, 240),
        # then a refine run on the task's rows whose loss adds the sparse actor's (every layer sparse,
        # 8 selected pages): the dense warm-up reads its line numbers through attention spread over the
        # whole trace (p5 ~0 past position 1000 at 32 pages, docs/results.md)
        refine_steps=300, refine_lr=5e-4, refine_batch_size=4, refine_sparse_topk=8, refine_sparse_weight=1.0,
        # off: a last run on rows whose look-ups slip to a neighbouring key (slip_prob of them), a flaw
        # for RL to remove; at 0.2 RL learns slowly, at 0.4 not in 20 steps (docs/results.md)
        slip_steps=0, slip_lr=3e-4, slip_batch_size=4, slip_prob=0.0))
    c.schedule.bin_width = 256  # by position: the first bin holds the prompt and generated positions 0-165
    c.rollout.max_new_tokens = 1354  # the longest reference trace (1440-token rows): only a missed terminal is cut
    c.schedule.selector = "centroid"  # the selector the warm-up's sparse loss trained with
    # the prompt's first 6 pages (96 tokens: the whole key table) always kept: the look-ups read the
    # table from anywhere in the trace, and with only the first page kept the tau = 0.86 arm's pooled p5
    # fell to 0.82 in its last bin (docs/results.md)
    c.schedule.reserved_first = 6
    # 96 pages cover every context of the task (<= 90 pages): a bin no sparse budget holds runs dense
    c.calibration.budgets = (4, 6, 8, 12, 16, 24, 32, 48, 96)
    c.calibration.tau = 0.86
    # the table's last bin (positions 1280+: the rollouts that run on past their terminal) holds few
    # tokens; the budget it picks there failed on fresh prompts (0.71 at 48 pages, docs/results.md)
    c.calibration.revalidate_rounds = 2
    # the tau = 0.75 arm trains on its schedule whatever its validation says (a p5 below the main tau
    # is what it tests); the main schedule passes its validation (docs/results.md)
    c.calibration.allow_failed = True
    # a bin's budget must also keep >= 95% of the largest budget's unbroken traces among the rows that reach
    # it: p5 alone picks 4 / 6 pages in the first two bins, where the look-ups' key letters (1.8% of the
    # tokens, under any 5th percentile) break the sparse traces (sampled reward 0.22 against dense 0.29 on
    # the validation prompts) and the policy they train lags dense (docs/results.md)
    c.calibration.min_survival = 0.95
    # that rule's counts on one greedy trace per prompt (64 prompts of their own): sampled traces break on
    # their own early (4 of 64 reached position 768), so the late bins went unmeasured and kept 24 pages,
    # where the sparse actor fell behind as RL lengthened its traces; greedy traces (the policy's best,
    # which RL sharpens it toward) reach every bin (docs/results.md)
    c.calibration.survival_decoding = "greedy"
    c.calibration.num_prompts = 32  # 64 rows: one row off its trace is 1.6% of a bin, not 6% (16 rows)
    c.calibration.validate_prompts = 32
    c.rollout.prompts_per_step = 8
    c.rollout.group_size = 4
    # the loss ends at each completion's first wrong line: later tokens cannot change its reward, and
    # without this the gradients of separate batches share no direction (docs/results.md)
    c.train.reward_horizon_mask = True
    # the update in 4 row groups sorted by reward horizon, each cut at its longest loss row: the same
    # gradient in about half the time (experiments/bench_horizon_groups.py, docs/results.md)
    c.train.horizon_groups = 4
    # the sparse actor's exact acceptance statistics (a teacher-forced sparse pass and a whole-row dense
    # pass) on every 4th step: the same training (tests/test_mismatch_every.py) in 2/3 of the step time;
    # the online arms still score every step (their controller reads each step's p5)
    c.train.mismatch_every = 4
    c.train.learning_rate = 5e-5
    # a KL anchor to the warm-up: without it the random-reward control's updates walk the dense policy
    # off its sharp optimum (0.27 -> 0.04 in 100 steps; at kl_coef 0.1, -0.05; docs/results.md)
    c.train.kl_coef = 0.5
    # the final norm (it scales every logit) at 1000x the rate: RL sharpens the policy toward its own
    # greedy answers (sampled 0.29, greedy 0.67 on the validation prompts), a direction every batch agrees
    # on, while the noisy updates of the other weights stay at the rate the KL anchor holds
    # (docs/results.md)
    c.train.lr_scale_params = r"^norm\."
    c.train.lr_scale = 1000.0
    c.steps = 100
    c.eval_every = 25  # validations at steps 0, 25, ..., 100: five points of the dense curve
    c.eval_k = 4
    c.checkpoint_every = 25
    c.task.num_train = 1024  # the setting that learned (64 prompts, 40 steps: +0.012; docs/results.md)
    c.task.num_eval = 32
    c.study = study_config()
    c.study.arms = ("dense", "calibrated", "calibrated_low", "calibrated_high", "online_dense", "random_reward")
    c.study.seeds = (0, 1)
    c.study.low_tau = 0.75  # the paper's collapse threshold, calibrated exactly as the main tau
    c.study.high_tau = 0.92  # the paper's stable but slower threshold, the same way
    c.study.measure_speedup = True
    # after training: every arm's final dense policy and the warm-up on 128 held-out prompts (the 16 validation
    # prompts first) with one sampling key, so changes and gaps to the dense arm get paired errors
    c.study.final_eval_prompts = 128
    return c
