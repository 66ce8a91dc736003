"""Building blocks of run configs (ml_collections). Every field has a default and a comment.

A run config file defines ``get_config()`` returning :func:`base_config` with fields
overridden; ``python -m experiments.run --config configs/x.py --config.steps=5`` overrides
any field from the command line. :func:`sparrow_jax.run.specs.parse_spec` parses and checks them once (a field
that no spec reads is an error). The optional blocks ``model.warmup`` (:func:`warmup_config`,
warm-up SFT settings) and ``study`` (:func:`study_config`) are added where used. docs/configs.md
lists every field with its default and comment (``python -m experiments.config_reference``).
"""
from __future__ import annotations

from ml_collections import ConfigDict


def model_config() -> ConfigDict:
    return ConfigDict(dict(
        source="tiny",  # "tiny" (random init from `tiny`), "hf" (load `hf_dir`), "warmup" (SFT-cached tiny model)
        hf_dir="",  # local Hugging Face directory when source == "hf"
        dtype="float32",  # compute dtype: float32 | bfloat16
        param_dtype="float32",  # parameter storage dtype
        tiny=ConfigDict(dict(  # Qwen3 architecture of the tiny model (source tiny / warmup); vocab: the tokenizer's
            hidden_size=128,  # residual stream width
            num_hidden_layers=4,  # decoder layers
            num_attention_heads=4,  # query heads
            num_key_value_heads=2,  # KV heads (grouped-query attention: query heads share them)
            head_dim=32,  # width of one attention head
            intermediate_size=256,  # MLP hidden width
            tie_word_embeddings=True,  # the unembedding reuses the token embedding
            rope_theta=10000.0,  # rotary position embedding base
            max_position_embeddings=8192,  # longest sequence (prompt + completion) the model accepts
        )),
    ))


def warmup_config() -> ConfigDict:
    """Optional block ``model.warmup`` (model.source warmup): the warm-up SFT's settings
    (sparrow_jax.sft.settings.WarmupSettings, whose defaults these are; a test checks) and its cache."""
    return ConfigDict(dict(
        steps=800,  # optimiser steps of the main phase
        batch_size=32,  # rows per step
        lr=3e-3,  # peak AdamW learning rate
        warmup_frac=0.05,  # share of steps of linear learning-rate warm-up before the cosine decay
        weight_decay=0.01,  # AdamW weight decay
        max_grad_norm=1.0,  # global-norm gradient clipping
        min_context=32,  # shortest context drawn for training rows (tokens)
        train_hops=3,  # training rows draw their hop count from [1, max(task.hops, train_hops)]
        queries_per_example=4,  # questions per training example about its records
        max_train_context=128,  # longest training context (tokens); evaluation also runs past it
        prompt_weight=0.0,  # weight of the prompt tokens' NLL next to the reference's (0: reference only)
        seed=0,  # parameter init and training-data seed
        max_train_hops=0,  # cap on training hop counts (0: no cap)
        final_frac=0.0,  # last share of the steps trained on the task's own context and hops (0: none)
        final_batch_size=4,  # rows per step of that final phase
        curriculum=(),  # stages ((steps, max_context, max_hops, batch_size[, lookup_every]), ...) before the final one
        lookup_every=0,  # recurrence_trace: curriculum rows look up every this many lines (0: task.far_every)
        lookup_weight=0.0,  # weight of an extra loss term: the mean NLL of the reference tokens after "=" (0: none)
        refine_steps=0,  # steps of a warm restart on the task's own rows after the main phase (0: none)
        refine_lr=1e-3,  # peak learning rate of the refine run
        refine_batch_size=4,  # rows per refine step
        refine_sparse_topk=0,  # pages of the sparse actor whose NLL the refine's loss adds (every layer sparse)
        refine_sparse_weight=0.0,  # weight of that sparse NLL term (0: none)
        slip_steps=0,  # recurrence_trace: steps of a run on rows whose look-ups slip to a neighbouring key (0: none)
        slip_lr=3e-4,  # peak learning rate of the slip run
        slip_batch_size=4,  # rows per slip step
        slip_prob=0.0,  # probability that a look-up of those rows reads a neighbouring key (> 0 with slip_steps)
        slip_sparse_topk=0,  # pages of the slip run's sparse NLL term (0: refine_sparse_topk)
        slip_sparse_weight=0.0,  # weight of the slip run's sparse NLL term (0: refine_sparse_weight)
        slip_reserved_first=1,  # first pages always kept in the slip run's sparse actor (1: the sampler's default)
        slip_selector="centroid",  # page scoring rule of the slip run's sparse actor: centroid | quest
        preamble_steps=0,  # steps of a run on rows with task.preamble_tokens after the warm-up without (0: none)
        preamble_lr=1e-3,  # peak learning rate of the preamble run
        preamble_batch_size=4,  # rows per preamble step
        cache_dir="runs/cache",  # parent of the warmup-<hash> cache directories (not in the hash)
        eval_lengths=(),  # context lengths of the final greedy-accuracy table (empty: a default spread)
        eval_hops=(),  # trace lengths of an accuracy table at task.context_tokens (empty: none)
        eval_prompts=64,  # held-out prompts per accuracy table entry
    ))


def task_config() -> ConfigDict:
    return ConfigDict(dict(
        name="pointer_chase",  # task registry name (sparrow_jax.data.registry)
        dataset="",  # optional local parquet/jsonl/json prompt file; empty: generate the built-in task
        context_tokens=512,  # built-in task: approximate prompt length in tokens
        hops=2,  # built-in task: pointer hops the answer needs
        distractor_frac=0.5,  # built-in task: share of near-duplicate distractor keys
        num_train=512,  # built-in task: training prompts generated (0 with task.dataset: the rows after the eval rows)
        num_eval=32,  # held-out prompts for evaluation and calibration validation
        seed=1234,  # generation seed of the built-in task
        key_len=3,  # built-in task: symbols per record key (also a warm-up cache knob)
        isolate_chain=False,  # built-in task: off-chain records point off the chain (a wrong turn never rejoins it)
        preamble_tokens=0,  # pointer_trace: tokens of unrelated text before the records (more context, same records)
        min_lines=0,  # recurrence_trace: the trace ends at the first fresh look-up past this line (0: default 100)
        far_every=0,  # recurrence_trace: one line in far_every is a look-up, a divisor of 100 (0: default 10)
        gap_tokens=0,  # recurrence_trace: tokens of unrelated text between the table and the start line
        key_letters=0,  # recurrence_trace: letters of a look-up key, 1 (20 keys) or 2 (100 keys; 0: the default 2)
        reward_workers=2,  # RewardPool processes, for tasks that score in a pool (math)
        reward_timeout_s=10.0,  # per-answer verifier timeout in the pool (a timeout scores 0)
    ))


def schedule_config() -> ConfigDict:
    return ConfigDict(dict(
        kind="calibrated",  # dense | fixed | preset | json | calibrated (derived by calibration in the run) | online
        topk=8,  # kind fixed: top-k pages
        preset="",  # kind preset: e.g. qwen3-4b-0.86
        path="",  # kind json: a schedule JSON written by calibration
        page_size=16,  # tokens per KV page
        bin_width=128,  # position bin width in tokens (paper: 2000; tiny contexts use less)
        reserved_first=1,  # always-kept first pages (attention sink)
        reserved_last=2,  # always-kept last pages (current and previous)
        dense_layers=(0,),  # layers that stay dense (paper: (0, 1); tiny models keep one)
        selector="centroid",  # centroid | quest
        impl="auto",  # sparse attention implementation: auto | reference | xla | cpu | pallas_tpu | pallas_gpu | triton
        cost_hardware="H200",  # hardware of the logged predicted rollout cost vs dense (cost_model.HARDWARE key)
        online=online_schedule_config(),  # kind online: the per-bin p5 controller (rollout/schedule_control.py)
    ))


def online_schedule_config() -> ConfigDict:
    return ConfigDict(dict(
        start="calibrated",  # first schedule: calibrated | preset | fixed (schedule.preset / topk) | dense (per bin, the
        #                      top-k covering the bin's whole context)
        margin=0.03,  # hysteresis: a bin's budget falls only when confidently above calibration.tau + margin
        up_levels=2,  # most grid levels a bin rises in one step when its smoothed p5 is below tau (one per margin short)
        down_levels=1,  # most grid levels a bin falls in one step when confidently above tau + margin (one more per
        #                 margin its lower bound clears that by)
        min_tokens=256,  # effective tokens a bin needs before its budget may move (thin bins hold)
        smoothing=0.7,  # per-step forgetting factor of the token-weighted p5 average, in [0, 1)
        z=1.64,  # one-sided normal quantile of the lower confidence bound for falls (1.64: 95%)
        patience=3,  # steps with tokens at the current budget before a fall (>= 2)
        retry_after=25,  # steps a bin keeps away from a budget where its p5 was below tau (a calibrated start
        #                  seeds this memory from its calibration table)
        levels_per_octave=4,  # top-k grid points per power of two (L / 2 per static k_max bucket: rare recompiles)
        min_topk=1,  # smallest top-k the controller may set
        max_topk=0,  # largest top-k (0: enough pages to cover the run's longest sequence, i.e. dense)
        probe=True,  # before a fall, score the step's rollouts at the lower budgets (teacher-forced sparse pass)
        probe_margin=0.02,  # a probed bin falls only when the lower bound of its candidate p5 is >= tau + probe_margin
    ))


def rollout_config() -> ConfigDict:
    return ConfigDict(dict(
        prompts_per_step=4,  # distinct prompts per RL step
        group_size=4,  # samples per prompt (GRPO group)
        max_new_tokens=64,  # completion cap
        temperature=1.0,  # sampling temperature (scorers use the same)
        top_p=1.0,  # nucleus truncation (1 disables)
        top_k=0,  # top-k truncation (0 disables)
        progress=False,  # print decode progress inside long generations
        # auto: continuous batching (finished rows free their slot and pages) on one device, the
        # fixed-batch sampler on a multi-device mesh (the page-pool kernel is not sharded yet)
        engine="auto",  # auto | continuous | fixed
    ))


def calibration_config() -> ConfigDict:
    return ConfigDict(dict(
        tau=0.86,  # the run's one p5 threshold per position bin: calibration targets it, the online controller holds it
        budgets=(1, 2, 4, 8, 16),  # grid of top-k pages to measure
        num_prompts=16,  # prompts used to build the budget x bin table
        samples_per_prompt=2,  # rollouts per calibration prompt
        validate_prompts=16,  # fresh prompts to validate the derived schedule
        percentile=5.0,  # tail percentile (the paper's p5)
        spread_prompts=True,  # spread prompt lengths up to task.context_tokens (False: all at it; long completions)
        min_count=40,  # completion tokens a (budget, bin) cell needs before its percentile counts
        # a failed validation raises the failed bins to the next budget (a bin at the largest: the bin before it)
        # and validates again on fresh prompts, up to this many times (0: off)
        revalidate_rounds=0,
        allow_failed=False,  # train on a schedule whose validation failed (False: the run stops before RL)
        # a budget must also keep the traces whole: per bin, among the rows whose loss reaches it, the share
        # not broken there (loss ending before the completion: train.reward_horizon_mask's horizon) at least
        # this times the largest budget's share (0: off, the paper's rule; tasks without a horizon: no effect)
        min_survival=0.0,
        # that rule's bins too few rows reach (< 16 at the largest budget): free (p5 alone) | largest (the
        # largest budget: their survival is unknown)
        survival_unmeasured="free",
        # that rule's rows: sampled (the tail's rows, at rollout.temperature) | greedy (one greedy trace on
        # each of num_prompts x samples_per_prompt prompts of their own: they reach the late bins that
        # sampled traces, broken on their own, rarely do)
        survival_decoding="sampled",
    ))


def train_config() -> ConfigDict:
    return ConfigDict(dict(
        learning_rate=1e-4,  # Adam learning rate of the policy
        # linear warm-up of that rate over this many steps, the k-th update at rate * k / N (verl's
        # lr_warmup_steps; 0: none):
        # Adam's first steps move every weight by the full rate, whatever the gradient's noise
        lr_warmup_steps=0,
        max_grad_norm=1.0,  # global-norm clipping (0 disables)
        # a regex over dotted parameter names (layers.0.self_attn.q_proj.kernel, embed_tokens, norm.weight):
        # the parameters it matches get no update ("": every parameter trains)
        frozen_params="",
        # a regex over the same names whose parameters move at lr_scale times learning_rate ("": none):
        # e.g. the final norm (^norm\.), which scales every logit, so RL can sharpen the policy at a rate
        # its noisy updates cannot walk the attention at (docs/results.md)
        lr_scale_params="",
        lr_scale=1.0,  # the multiple of learning_rate for the parameters lr_scale_params matches
        adv_mode="grpo",  # grpo (std-normalised) | drgrpo
        # each token's baseline: group (the group's mean reward, one advantage per completion) | prefix
        # (the mean reward of the group's completions sharing the token's prefix: tokens the group shares
        # get no net update, the update sits where its samples part; sparrow_jax/rl/advantages.py)
        adv_baseline="group",
        # the tokens the acceptance-rate tail counts (calibration, its validation, each step's mismatch/*
        # statistics, the online controller): completion (every completion token) | loss (with
        # reward_horizon_mask, those up to each completion's reward horizon: the tokens past it get no
        # update, and on a prefix reward a sparse rollout's tokens after its first error are most of its
        # tail; alone it misses the few tokens that end traces early, so a calibration on it can pick
        # budgets that kill traces: docs/results.md)
        tail_tokens="completion",
        clip_low=0.2,  # PPO epsilon below 1
        clip_high=0.28,  # PPO epsilon above 1 (clip-higher)
        dual_clip=0.0,  # dual-clip constant for negative advantages (0 disables)
        loss_agg="token-mean",  # token-mean | seq-mean-token-mean | seq-mean-token-sum
        tis_cap=3.0,  # truncated importance sampling cap C (0 disables TIS)
        tis_level="token",  # token | sequence
        # reject tokens (tis_level token) or sequences whose ratio p_dense_old / p_sampler is outside
        # [low, high] (both 0: off); the reciprocal of verl's rollout_rs k1 thresholds (ours = 1 / theirs)
        tis_mask_low=0.0,  # lower ratio bound of the rejection mask
        tis_mask_high=0.0,  # upper ratio bound of the rejection mask
        # with sparse rollouts, reject a whole row (no loss; its group's advantages over the rows kept) where
        # a loss token's ratio p_dense_old / p_sampler is below this: the trained policy would rarely have
        # made that error (verl's rollout_token_veto_threshold; 0: off)
        tis_veto=0.0,
        # the tokens the veto reads: loss (every loss token) | horizon_line (with reward_horizon_mask, the tokens
        # of each row's first wrong line: a row is rejected only when the error that ended its reward is one
        # the dense policy would rarely have made; a row with nothing wrong is never rejected)
        tis_veto_tokens="loss",
        # a group's advantages with the veto: kept (mean and std over its kept rows; a group left with one row
        # gives none) | all (over all its rows, as without the veto; only the rejected rows get 0)
        tis_veto_baseline="kept",
        # seq-mean loss divisor: valid (non-empty rows) | all (every row, as verl) | auto (all iff masking is on)
        seq_mean_rows="auto",
        kl_coef=0.0,  # KL-to-reference coefficient; the reference is the initial policy (0: none kept)
        kl_kind="k3",  # k1 | k2 | k3 (verl low_var_kl, clamped to [-10, 10])
        entropy_coef=0.0,  # entropy bonus
        ppo_epochs=1,  # PPO epochs: passes over each rollout batch
        mini_batches=1,  # optimiser updates per epoch, each on 1 / mini_batches of the batch's rows
        micro_batches=1,  # gradient accumulation chunks per mini-batch (memory only: same update)
        overlong_buffer=0,  # DAPO soft overlong penalty: ramp length before rollout.max_new_tokens (0: off)
        overlong_penalty=1.0,  # DAPO soft overlong penalty at the cap, in reward units
        mask_truncated=False,  # DAPO: completions cut at max_new_tokens (no stop token) leave the loss
        # tokens after a completion's reward horizon (its first wrong line, on tasks whose reward
        # ignores what follows: recurrence_trace) leave the policy loss, not the statistics
        reward_horizon_mask=False,
        # with reward_horizon_mask: the update runs in this many row groups sorted by where their loss
        # ends, each cut at its longest loss row (the same gradient, less forward and backward past the
        # horizon; rollout_corr/ metrics then cover the computed positions without a sparse schedule; 0: off)
        horizon_groups=0,
        # N: the sparse actor's exact acceptance statistics (its teacher-forced pass: mismatch/* and
        # alpha_hist) on every N-th step only, the others skip that pass; TIS reads the sampler's
        # log-probs on every step (with horizon_groups, a skipped step's rollout_corr/ metrics cover the
        # computed positions). 1 with an online schedule or DistillSparse (they read every step; a study's online
        # arms run at 1 whatever it says)
        mismatch_every=1,
        dynamic_sampling=False,  # DAPO: drop groups with equal rewards, sample more until the batch is full
        dynamic_sampling_rounds=3,  # extra sampling rounds per step; a batch still short keeps equal-reward groups
        max_nonfinite_steps=3,  # stop after this many steps in a row with a skipped non-finite update (0: never)
        remat=False,  # rematerialise layer activations (long sequences)
        # the random-reward control: the update learns from 0/1 coin flips with the batch's mean reward
        # (the logged reward_mean stays the real one); a held-out gain then is not from the reward
        random_reward=False,
    ))


def distill_config() -> ConfigDict:
    return ConfigDict(dict(
        enabled=False,  # DistillSparse: train a LoRA used only by the sparse actor
        rank=8,  # LoRA rank
        alpha=16.0,  # LoRA alpha (scale alpha / rank)
        targets=("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),  # adapted layers
        learning_rate=1e-4,  # Adam learning rate of the LoRA (its own optimiser)
        kl_coef=1e-3,  # lambda in L_LoRA = L_PPO_sparse + lambda * L_KL
        # exact_reverse: KL(sparse||dense) | exact: KL(dense||sparse) (both full vocabulary) | k3 (the
        # release's sampled estimate of the reverse KL). Forward KL made the on-policy actor hedge
        # and its reward fall (0.034 vs 0.082 without LoRA, 40 steps); reverse kept it (0.088).
        kl="exact_reverse",
        tis_cap=3.0,  # TIS cap of the sparse PPO term (0 disables)
        updates_per_step=1,  # LoRA optimiser steps per RL step on the same batch (PPO epochs of the LoRA)
        switch_topk=0,  # phase 2: a more aggressive fixed top-k to switch to (0: never switch)
        switch_every=0,  # steps between checks of the LoRA-aided p5 under switch_topk (0: never)
        compare_without=True,  # also run the same RL without LoRA for the report's reward comparison
        eval_samples=4,  # completions per held-out prompt for the report's p5 before / after
    ))


def base_config() -> ConfigDict:
    c = ConfigDict()
    c.workdir = "runs/default"  # every output goes under here
    c.seed = 0  # PRNG seed of the run
    c.steps = 10  # RL steps
    c.checkpoint_every = 5  # steps between checkpoints
    c.keep_checkpoints = 2  # checkpoints kept
    c.eval_every = 0  # steps between dense / sparse validations, also run at step 0 and the end (0: steps // 3)
    c.eval_k = 4  # samples per held-out prompt for val/*/reward_mean@k and success@k
    c.tokenizer = "builtin"  # builtin | path to a HF tokenizer directory
    c.dry_run = False  # print the run's memory plan for its mesh and stop before loading weights
    c.model = model_config()
    c.task = task_config()
    c.schedule = schedule_config()
    c.rollout = rollout_config()
    c.calibration = calibration_config()
    c.train = train_config()
    c.distill = distill_config()
    c.mesh = ConfigDict(dict(  # device mesh (sparrow_jax.parallel.mesh); product = device count
        data=1,  # data-parallel axis: batch rows split, parameters replicated
        fsdp=1,  # fully sharded axis: batch rows and parameters / optimiser state split
        tensor=1,  # tensor-parallel axis: attention heads and MLP units split
    ))
    return c


def study_config() -> ConfigDict:
    """Optional block ``study``: run the arms one after another with the same seeds, each in
    ``<workdir>/<arm>`` (``<workdir>/<arm>/seed_<s>`` with several seeds), and compare them in
    ``<workdir>/report.json``, ``study.png`` and ``headline.png``."""
    return ConfigDict(dict(
        aggressive_topk=1,  # top-k pages of the aggressive fixed-budget arm (plus the reserved pages)
        # any of sparrow_jax.run.specs.STUDY_ARMS; online_*: schedule.kind online started dense, at
        # the aggressive budget, or calibrated with DistillSparse; calibrated_low / calibrated_high:
        # calibrated as the main schedule but at low_tau / high_tau (into <workdir>/calibrated_low /
        # calibrated_high); random_reward: dense rollouts,
        # train.random_reward (the update learns from coin flips)
        arms=("dense", "calibrated", "aggressive"),  # arms run, in order
        # every arm runs once per seed, the same seeds for every arm: empty is the run's seed alone, in
        # <workdir>/<arm>; several seeds run in <workdir>/<arm>/seed_<s>
        seeds=(),
        low_tau=0.75,  # calibration.tau of the calibrated_low arm, in (0, calibration.tau) (paper: collapse)
        high_tau=0.92,  # calibration.tau of the calibrated_high arm, in (calibration.tau, 1) (paper: stable, slower)
        # after an arm's first seed, time its final schedule's rollouts against dense ones like for like
        # (sparrow_jax.run.speed; minutes per sparse arm)
        measure_speedup=False,
        # > 0: after training, every arm's final dense policy (each seed) and the starting policy sampled
        # densely with one key on this many held-out prompts (the validation prompts first), rewards kept
        # per prompt in <workdir>/final_eval.json: each arm's change and its difference from the dense arm
        # get paired standard errors (sparrow_jax.run.final_eval). A finished study gains it when rerun.
        final_eval_prompts=0,
        # its prompts start this many held-out prompts in (0: the validation prompts first): prompts no setting
        # of the study was chosen on; a finished study rerun with another offset keeps the earlier record aside
        final_eval_offset=0,
    ))
