"""Installs rl_jax: stable RL of (MoE) language models under training-inference mismatch."""
from setuptools import find_packages, setup

setup(
    name="rl_jax",
    version="0.1.0",
    description="JAX research codebase for stable RL of (MoE) LMs under training-inference mismatch",
    packages=find_packages(include=["rl_jax", "rl_jax.*"]),
    python_requires=">=3.11",
    install_requires=[
        # jax 0.10.x resolves on Python 3.11, 0.12.x on 3.12.
        "jax>=0.10.0,<0.13",
        "jaxlib>=0.10.0,<0.13",
        "flax>=0.12.0,<0.13",
        "optax>=0.2.4",
        "orbax-checkpoint>=0.11",
        "chex>=0.1.90",
        "ml-collections>=1.0",
        "einops>=0.8",
        "tensorstore>=0.1.70",
        "wandb>=0.19",
        "absl-py>=2.1",
        "ml-dtypes>=0.5",
        "numpy>=1.26",
        "tqdm>=4.66",
        "matplotlib>=3.8",
        "safetensors>=0.4",
        "tokenizers>=0.20",
    ],
    extras_require={
        "test": ["pytest>=8", "hypothesis>=6.100", "pytest-timeout>=2.3"],
        # torch pinned to the CPU wheel on disk: a looser range pulls a multi-GB CUDA build.
        "hf": ["torch==2.13.0", "transformers>=4.51"],
    },
)
