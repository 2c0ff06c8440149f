"""rl_jax: stable RL of (mixture-of-experts) language models under training-inference mismatch."""

__version__ = "0.1.0"
