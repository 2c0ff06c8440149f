"""Installs rl_jax: stable RL of (MoE) language models under training-inference mismatch."""
from setuptools import find_packages, setup

setup(
    name="rl_jax",
    version="0.1.0",
    description="JAX research codebase for stable RL of (MoE) LMs under training-inference mismatch",
    # configs/ ships too, as `rl_jax.configs` (the folder stays at the top of the repository):
    # notebooks, tests and the study runner import experiment configs as a package, and nothing
    # named `configs` lands in site-packages beside a user's own.
    packages=find_packages(include=["rl_jax", "rl_jax.*"]) + ["rl_jax.configs"],
    package_dir={"rl_jax.configs": "configs"},
    # The native handlers' sources: built with the system's compiler on first use (rl_jax/ops/native_build.py).
    package_data={"rl_jax.ops": ["native/*.cc", "native/*.h"]},
    python_requires=">=3.11",
    install_requires=[
        # jax 0.10.x resolves on Python 3.11, 0.12.x on 3.12.
        "jax>=0.10.0,<0.13",
        "jaxlib>=0.10.0,<0.13",
        "flax>=0.12.0,<0.13",
        "optax>=0.2.4",
        "orbax-checkpoint>=0.11",
        # Every workdir read/write goes through etils.epath (local, gs://, ...): rl_jax/workdir.py.
        "etils[epath]>=1.7",
        "chex>=0.1.90",
        "ml-collections>=1.0",
        "einops>=0.8",
        # orbax's storage layer; rl_jax asks for it by name for the design card's checkpoint stack.
        "tensorstore>=0.1.70",
        "wandb>=0.19",
        "absl-py>=2.1",
        "ml-dtypes>=0.5",
        "numpy>=1.26",
        "tqdm>=4.66",
        "matplotlib>=3.8",
        # rl_jax.study.publish downscales study figures for docs/ (matplotlib needs it anyway).
        "pillow>=10",
        "tokenizers>=0.20",
        # The dataset task: parquet prompt files (rl_jax/tasks/records.py) and the math verifier
        # (rl_jax/tasks/verifiers.py; math-verify brings sympy and the LaTeX parser).
        "pyarrow>=14",
        "math-verify>=0.7",
        # Chat templates render through jinja2 (rl_jax/tasks/hf_tokenizer.py), as transformers does.
        "jinja2>=3.1",
        # rl_jax.study.stats: the paired t / Wilcoxon tests and power of the pre-registered studies.
        "scipy>=1.11",
        # A host allocator in a wheel (libmimalloc.so under site-packages/cmeel.prefix/lib) that the
        # CPU entry points preload (rl_jax/host_memory.py): glibc malloc re-faults XLA:CPU's
        # temporaries every step. No wheel for other platforms: there a system tcmalloc serves.
        "cmeel-mimalloc>=3.4; sys_platform == 'linux' and platform_machine == 'x86_64'",
    ],
    extras_require={
        # safetensors: only tests import it (the runtime reads and writes the format itself);
        # nbclient / ipykernel / nbformat execute the notebooks in tests/test_notebooks.py.
        # pytest-xdist: the suite runs one worker per core (pytest.ini).
        "test": ["pytest>=8", "pytest-xdist>=3.5", "hypothesis>=6.100", "pytest-timeout>=2.3", "safetensors>=0.4",
                 "nbclient>=0.10", "ipykernel>=6.29", "nbformat>=5.10"],
        # `pip install -e ".[notebooks]"`, then `jupyter lab notebooks/`.
        "notebooks": ["jupyterlab>=4", "nbclient>=0.10", "ipykernel>=6.29", "nbformat>=5.10"],
        # torch pinned to the CPU wheel on disk: a looser range pulls a multi-GB CUDA build.
        "hf": ["torch==2.13.0", "transformers>=4.51"],
        # Accelerators: jax's own extras (the CUDA 12 / 13 plugin and NVIDIA wheels; libtpu), in the
        # same version range as the core pin. `pip install -e ".[cuda12]"` on a GPU host; the H200 run
        # in docs/performance.md used jax 0.11.2's CUDA 13 plugin (driver 580).
        "cuda12": ["jax[cuda12]>=0.10.0,<0.13"],
        "cuda13": ["jax[cuda13]>=0.10.0,<0.13"],
        "tpu": ["jax[tpu]>=0.10.0,<0.13"],
        # Remote prompt files, workdirs and checkpoints: etils.epath reaches gs:// through gcsfs and
        # s3:// through s3fs, neither of which it installs (docs/configs.md#dataset-task).
        "gcs": ["gcsfs>=2023.1"],
        "s3": ["s3fs>=2023.1"],
    },
)
