"""Fake GPU nodes through kwok: the real scheduler places GPU pods on them, kwok marks them Running.

The nodes carry `nvidia.com/gpu` capacity, the label `anneal.dev/node-type=kwok-gpu` and the taint
`nvidia.com/gpu=present:NoSchedule` (as managed GPU clusters do). The API server runs the
ExtendedResourceToleration admission plugin, so pods that request `nvidia.com/gpu` tolerate it
automatically and every other pod (the operator, CPU engines, jobs) goes to the runner's node.
Nothing runs for kwok pods; their pod IPs come from a range nothing listens on.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .cluster import LocalCluster

NODE_TYPE_LABEL = "anneal.dev/node-type"
KWOK_NODE_TYPE = "kwok-gpu"
POD_CIDR = "10.244.0.0/16"


def gpu_node(name: str, gpus: int) -> dict:
    capacity = {"cpu": "64", "memory": "1Ti", "pods": "110", "nvidia.com/gpu": str(gpus),
                "ephemeral-storage": "1Ti"}
    return {
        "apiVersion": "v1", "kind": "Node",
        "metadata": {"name": name,
                     "annotations": {"kwok.x-k8s.io/node": "fake"},
                     "labels": {NODE_TYPE_LABEL: KWOK_NODE_TYPE, "kubernetes.io/hostname": name,
                                "kubernetes.io/os": "linux", "kubernetes.io/arch": "amd64",
                                "nvidia.com/gpu.present": "true", "type": "kwok"}},
        "spec": {"taints": [{"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"}]},
        "status": {"capacity": capacity, "allocatable": capacity},
    }


def start_kwok(cluster: "LocalCluster", timeout: float) -> None:
    """Start kwok for the labelled nodes, create them, and wait until they are Ready."""
    from .cluster import GPU_NODE_PREFIX
    stages = cluster.bin_dir / "kwok-stages.yaml"
    if not stages.is_file():
        raise RuntimeError(f"{stages} is missing: run e2e/cluster/build again")
    cluster._start("kwok", [
        str(cluster.bin_dir / "kwok"), f"--kubeconfig={cluster.kubeconfig}", f"--config={stages}",
        "--manage-all-nodes=false", f"--manage-nodes-with-label-selector={NODE_TYPE_LABEL}={KWOK_NODE_TYPE}",
        "--node-ip=127.0.0.1", f"--cidr={POD_CIDR}", "--node-lease-duration-seconds=40",
    ])
    names = [f"{GPU_NODE_PREFIX}{i}" for i in range(cluster.gpu_nodes)]
    manifest = json.dumps({"apiVersion": "v1", "kind": "List",
                           "items": [gpu_node(n, cluster.gpus_per_node) for n in names]})
    cluster.kubectl("apply", "-f", "-", input=manifest, check=True)
    for n in names:
        cluster._wait_for(lambda n=n: cluster._node_ready(n), f"kwok node {n} to be Ready", timeout, "kwok")
