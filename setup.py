"""sparrow-jax: sparse rollouts kept stable by tail statistics (the Sparrow method) in JAX."""
from setuptools import find_packages, setup

CORE = [
    "jax>=0.10",
    "flax>=0.12",
    "optax",
    "orbax-checkpoint",
    "ml-collections",
    "absl-py",
    "datasets",
    "tensorstore",
    "safetensors",
    "tokenizers",
    "math-verify",
    "matplotlib",
    "tqdm",
    "tensorboardX",
    "numpy",
    "pebble",  # RewardPool: process pool with per-task timeouts
]
HF = ["torch==2.13.0", "transformers>=4.51"]  # torch CPU build: parity tests and the HF peer benchmark
TEST = ["pytest", "pytest-xdist", "nbclient", "nbformat", "ipykernel"]

setup(
    name="sparrow-jax",
    version="0.1.0",
    description="Sparse-rollout RL for long-context LLMs (Sparrow) in JAX: CPU, GPU, TPU.",
    python_requires=">=3.11",
    packages=find_packages(include=["sparrow_jax*", "pallas_kernels*", "configs*", "experiments*"]),
    package_data={"sparrow_jax": ["rollout/presets/*.json", "attention/cpu_kernel/*.cc", "attention/cpu_kernel/*.h",
                                  "sft/checkpoints/*/*.json", "sft/checkpoints/*/*.safetensors"]},
    install_requires=CORE,
    extras_require={
        "test": TEST + HF,
        "hf": HF,
        "gpu": ["jax[cuda13]"],
        "triton": ["jax-triton"],  # optional, guarded import: not every jax version works with it
        "tpu": ["jax[tpu]"],
        "peers": ["google-tunix==0.1.7"] + HF,  # optional, guarded import: benchmark peers (tunix sampler, HF)
    },
)
