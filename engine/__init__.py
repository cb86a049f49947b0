"""The persistent, hot-reloadable inference engine.

Torch-free modules (safe to import in the operator image): `plan`, `traffic`, `presets`.
Everything else imports torch.
"""
