"""The sampler `q`: KV-cache generation recording logq / top-k / experts (generate.py), weight sync (weights.py)."""
