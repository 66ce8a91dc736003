"""The paper's setting on a real Qwen3: GRPO + TIS on math problems with sparse rollouts at the
published tau = 0.86 schedule, one 8-device host (8 GPUs or a TPU v5p-8).

    python -m experiments.run --config configs/qwen3_math.py --config.dry_run=True   # memory plan only
    python -m experiments.run --config configs/qwen3_math.py

Change the five values right below (or pass them as --config.<field>=...): the snapshot, the
data, the schedule of the same model size, the mesh and the workdir. ``docs/real_models.md``
walks through a run, the data schema, the printed figures and several hosts.
"""
from configs.common import base_config

# ---- what a user sets ------------------------------------------------------------------------
HF_DIR = "checkpoints/Qwen3-1.7B"  # --config.model.hf_dir: local HF snapshot (config.json, *.safetensors, tokenizer)
DATASET = "data/math/train.parquet"  # --config.task.dataset: parquet/jsonl with a prompt and an answer column
PRESET = "qwen3-1.7b-0.86"  # --config.schedule.preset: the model size's published schedule, qwen3-{1.7b,4b,8b,14b}-0.86
MESH = dict(data=1, fsdp=8, tensor=1)  # --config.mesh.*: product = the devices of all hosts (fsdp: shard weights)
WORKDIR = "runs/qwen3_math"  # --config.workdir: checkpoints, metrics.jsonl, report.json


def get_config():
    c = base_config()
    c.workdir = WORKDIR
    c.steps = 500
    c.checkpoint_every = 10
    c.keep_checkpoints = 2
    c.eval_every = 0
    c.eval_k = 4

    c.model.source = "hf"
    c.model.hf_dir = HF_DIR  # its own tokenizer.json and chat template are used (tokenizer = builtin)
    c.model.dtype = "bfloat16"  # activations and KV cache
    # Master weights stay float32: an Adam step of lr 1e-6 is below bfloat16's resolution (2^-8 relative).
    c.model.param_dtype = "float32"

    c.task.name = "math"  # prompt through the chat template, math-verify reward on the last \boxed{} in a pool
    c.task.dataset = DATASET
    c.task.num_train = 0  # with a dataset: the file's rows after the held-out ones are the training prompts
    c.task.num_eval = 16  # the first rows are held out: the final evaluation decodes num_eval x eval_k rows at once
    c.task.reward_workers = 8  # verifier processes
    c.task.reward_timeout_s = 10.0

    c.rollout.prompts_per_step = 8
    c.rollout.group_size = 8  # the release's group size
    c.rollout.max_new_tokens = 32768  # the paper's 32K cutoff (Qwen3 attends over 40960 positions)
    c.rollout.temperature = 1.0
    c.rollout.top_p = 1.0

    c.schedule.kind = "preset"  # online: the per-bin p5 controller, started from the preset (online.start)
    c.schedule.preset = PRESET
    c.schedule.page_size = 16  # the presets' layout, also the online controller's
    c.schedule.bin_width = 2000
    c.schedule.reserved_first = 1
    c.schedule.reserved_last = 2
    c.schedule.dense_layers = (0, 1)
    c.schedule.online.start = "preset"
    c.calibration.tau = 0.86  # the tau the controller holds and the report compares p5 with

    c.train.learning_rate = 1e-6  # the release's settings: lr, clip-higher 0.2 / 0.28, no KL, no entropy bonus
    c.train.max_grad_norm = 1.0
    c.train.adv_mode = "grpo"
    c.train.clip_low = 0.2
    c.train.clip_high = 0.28
    c.train.loss_agg = "token-mean"
    c.train.tis_cap = 3.0  # TIS: sparse sampler vs dense policy
    c.train.tis_level = "token"
    c.train.kl_coef = 0.0
    c.train.entropy_coef = 0.0
    c.train.ppo_epochs = 1
    c.train.mini_batches = 1
    c.train.micro_batches = 4  # 16 rows of 32K tokens per pass (memory only)
    c.train.remat = True
    c.mesh.update(MESH)
    return c
