"""The sampler `q`: jitted KV-cache generation recording logq, top-k and experts (generate.py); weight sync (weights.py)."""
