"""The sampler `q`: KV-cache generation (generate.py), weight sync (weights.py), config and model-fit checks."""
