"""The local control plane behaves like a cluster: API, controllers, scheduler, kwok GPU nodes."""

from __future__ import annotations

import json

import pytest
from cluster.services import ServiceNotReady
from cluster.waiting import wait_for

pytestmark = pytest.mark.e2e


def get_json(cluster, *args) -> dict:
    out = cluster.kubectl("get", *args, "-o", "json")
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def test_api_server_is_ready(cluster):
    out = cluster.kubectl("get", "--raw", "/readyz")
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"
    version = json.loads(cluster.kubectl("version", "-o", "json").stdout)
    assert version["serverVersion"]["gitVersion"].startswith("v1.")


def test_nodes_gpu_and_local(cluster):
    nodes = get_json(cluster, "nodes")["items"]
    by_type = {}
    for n in nodes:
        by_type.setdefault(n["metadata"]["labels"].get("anneal.dev/node-type"), []).append(n)
    assert len(by_type["kwok-gpu"]) == 2
    for n in by_type["kwok-gpu"]:
        assert n["status"]["allocatable"]["nvidia.com/gpu"] == "8"
    local = [n for n in nodes if n["metadata"]["labels"].get("anneal.dev/local-exec") == "true"]
    assert len(local) == 1
    for n in nodes:
        ready = [c for c in n["status"]["conditions"] if c["type"] == "Ready"][0]
        assert ready["status"] == "True", n["metadata"]["name"]


GPU_DEPLOYMENT = """
apiVersion: apps/v1
kind: Deployment
metadata: {name: gpu-app, namespace: default}
spec:
  replicas: 2
  selector: {matchLabels: {app: gpu-app}}
  template:
    metadata: {labels: {app: gpu-app}}
    spec:
      containers:
      - name: main
        image: example.invalid/engine:latest
        resources: {limits: {nvidia.com/gpu: 1}}
"""


def test_gpu_deployment_lands_on_kwok_nodes_and_is_collected(cluster):
    cluster.kubectl("apply", "-f", "-", input=GPU_DEPLOYMENT, check=True)

    def running():
        pods = get_json(cluster, "pods", "-l", "app=gpu-app")["items"]
        ok = [p for p in pods if p["status"].get("phase") == "Running"]
        return pods if len(ok) == 2 else None

    pods = wait_for(running, 90, "2 GPU pods Running")
    for p in pods:
        assert p["spec"]["nodeName"].startswith("kwok-gpu-"), p["spec"]["nodeName"]
        # ExtendedResourceToleration gave the pod the GPU taint's toleration.
        assert any(t.get("key") == "nvidia.com/gpu" for t in p["spec"]["tolerations"])
    rs = get_json(cluster, "replicasets", "-l", "app=gpu-app")["items"]
    assert len(rs) == 1 and rs[0]["metadata"]["ownerReferences"][0]["kind"] == "Deployment"

    # Their Service gets an IPv4 EndpointSlice, but nothing runs there, so tests cannot call it.
    cluster.kubectl("create", "service", "clusterip", "gpu-app", "--tcp=8000:8000", check=True)
    slices = wait_for(lambda: [s for s in get_json(cluster, "endpointslices", "-l",
                                                   "kubernetes.io/service-name=gpu-app")["items"]
                               if len([e for e in s.get("endpoints") or [] if e["conditions"]["ready"]]) == 2],
                      30, "an EndpointSlice with both GPU pods")
    assert slices[0]["addressType"] == "IPv4"
    with pytest.raises(ServiceNotReady, match="kwok"):
        cluster.service_url("gpu-app", "default", 8000, timeout=5)

    cluster.kubectl("delete", "deployment,service", "gpu-app", "--wait=false", check=True)
    wait_for(lambda: not get_json(cluster, "replicasets", "-l", "app=gpu-app")["items"]
             and not get_json(cluster, "pods", "-l", "app=gpu-app")["items"],
             90, "garbage collection of the ReplicaSet and its pods")


def test_cpu_pod_does_not_land_on_gpu_nodes(cluster):
    cluster.kubectl("run", "cpu-only", "--image=unused", "--restart=Never", "--",
                    "python", "-c", "print('ran')", check=True)
    try:
        pod = wait_for(lambda: (lambda p: p if p["status"].get("phase") == "Succeeded" else None)(
            get_json(cluster, "pod", "cpu-only")), 60, "cpu-only to succeed")
        assert pod["spec"]["nodeName"] == "anneal-local"
        assert "ran" in cluster.pod_log("default", "cpu-only")
        logs = cluster.kubectl("logs", "cpu-only")  # through the API server to the runner's log API
        assert logs.returncode == 0 and logs.stdout == "ran\n", logs.stderr
    finally:
        cluster.kubectl("delete", "pod", "cpu-only", "--wait=false")
