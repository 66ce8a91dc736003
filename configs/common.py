"""Building blocks of run configs (ml_collections). Every field has a default and a comment.

A run config file defines ``get_config()`` returning :func:`base_config` with fields
overridden; ``python -m experiments.run --config configs/x.py --config.steps=5`` overrides
any field from the command line. :func:`sparrow_jax.run.specs.parse_spec` parses and checks them once (a field
that no spec reads is an error). The optional blocks ``model.warmup`` (warm-up SFT settings,
see configs/calibrate_tiny.py) and ``study`` (configs/study_tiny.py) are added where used.
"""
from __future__ import annotations

from ml_collections import ConfigDict


def model_config() -> ConfigDict:
    return ConfigDict(dict(
        source="tiny",  # "tiny" (random init from `tiny`), "hf" (load `hf_dir`), "warmup" (SFT-cached tiny model)
        hf_dir="",  # local Hugging Face directory when source == "hf"
        dtype="float32",  # compute dtype: float32 | bfloat16
        param_dtype="float32",  # parameter storage dtype
        tiny=ConfigDict(dict(  # Qwen3 architecture of the tiny model (source tiny / warmup)
            vocab_size=128, hidden_size=128, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, head_dim=32, intermediate_size=256, tie_word_embeddings=True,
            rope_theta=10000.0, max_position_embeddings=8192)),
    ))


def task_config() -> ConfigDict:
    return ConfigDict(dict(
        name="pointer_chase",  # task registry name (sparrow_jax.data.registry)
        dataset="",  # optional local parquet/jsonl/json prompt file; empty: generate the built-in task
        context_tokens=512,  # built-in task: approximate prompt length in tokens
        hops=2,  # built-in task: pointer hops the answer needs
        distractor_frac=0.5,  # built-in task: share of near-duplicate distractor keys
        num_train=512,  # built-in task: training prompts generated
        num_eval=32,  # held-out prompts for evaluation and calibration validation
        seed=1234,  # generation seed of the built-in task
        key_len=3,  # built-in task: symbols per record key (also a warm-up cache knob)
    ))


def schedule_config() -> ConfigDict:
    return ConfigDict(dict(
        kind="calibrated",  # dense | fixed | preset | json | calibrated (derived by calibration in the run)
        topk=8,  # kind fixed: top-k pages
        preset="",  # kind preset: e.g. qwen3-4b-0.86
        path="",  # kind json: a schedule JSON written by calibration
        page_size=16,  # tokens per KV page
        bin_width=128,  # position bin width in tokens (paper: 2000; tiny contexts use less)
        reserved_first=1,  # always-kept first pages (attention sink)
        reserved_last=2,  # always-kept last pages (current and previous)
        dense_layers=(0,),  # layers that stay dense (paper: (0, 1); tiny models keep one)
        selector="centroid",  # centroid | quest
        impl="auto",  # sparse attention implementation: auto | reference | xla | cpu | pallas_tpu | pallas_gpu
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
    ))


def calibration_config() -> ConfigDict:
    return ConfigDict(dict(
        tau=0.86,  # target p5 acceptance rate per position bin
        budgets=(1, 2, 4, 8, 16),  # grid of top-k pages to measure
        num_prompts=16,  # prompts used to build the budget x bin table
        samples_per_prompt=2,  # rollouts per calibration prompt
        validate_prompts=16,  # fresh prompts to validate the derived schedule
        percentile=5.0,  # tail percentile (the paper's p5)
        spread_prompts=True,  # spread prompt lengths up to task.context_tokens (False: all at it; long completions)
        min_count=40,  # completion tokens a (budget, bin) cell needs before its percentile counts
    ))


def train_config() -> ConfigDict:
    return ConfigDict(dict(
        learning_rate=1e-4,  # Adam learning rate of the policy
        max_grad_norm=1.0,  # global-norm clipping (0 disables)
        adv_mode="grpo",  # grpo (std-normalised) | drgrpo
        clip_low=0.2,  # PPO epsilon below 1
        clip_high=0.28,  # PPO epsilon above 1 (clip-higher)
        dual_clip=0.0,  # dual-clip constant for negative advantages (0 disables)
        loss_agg="token-mean",  # token-mean | seq-mean-token-mean | seq-mean-token-sum
        tis_cap=3.0,  # truncated importance sampling cap C (0 disables TIS)
        tis_level="token",  # token | sequence
        kl_coef=0.0,  # KL-to-reference coefficient (0: no reference model)
        kl_kind="k3",  # k1 | k2 | k3
        entropy_coef=0.0,  # entropy bonus
        micro_batches=1,  # gradient accumulation micro-batches per step
        remat=False,  # rematerialise layer activations (long sequences)
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
    c.eval_every = 0  # steps between evaluations (0: only at the end)
    c.eval_k = 4  # samples per eval prompt for mean@k / pass@k
    c.tokenizer = "builtin"  # builtin | path to a HF tokenizer directory
    c.model = model_config()
    c.task = task_config()
    c.schedule = schedule_config()
    c.rollout = rollout_config()
    c.calibration = calibration_config()
    c.train = train_config()
    c.distill = distill_config()
    c.mesh = ConfigDict(dict(data=1, fsdp=1, tensor=1))  # device mesh; product = device count
    return c
