"""Anneal: continuous compilation for open-model inference on Kubernetes.

The distribution provides three import packages: `anneal.engine` (the persistent, hot-reloadable
inference engine), `anneal.agents` (the compiler) and `anneal.operator` (the kopf operator).
"""

__version__ = "0.1.0"
