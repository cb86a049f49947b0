"""The op registry: every op the models call, its plain-PyTorch reference and its variants."""
