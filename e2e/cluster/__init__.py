"""A local Kubernetes control plane for the e2e suite (see cluster.py, runner.py, build)."""

from .cluster import ClusterError, LocalCluster

__all__ = ["ClusterError", "LocalCluster"]
