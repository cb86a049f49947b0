"""The local runner plays kubelet: pod IPs, readiness, Services, env and volumes, Jobs, deletion."""

from __future__ import annotations

import functools
import ipaddress
import json
import os
import sys
from pathlib import Path

import httpx
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from cluster import LocalCluster, procs  # noqa: E402
from cluster.waiting import wait_for as _wait_for  # noqa: E402

pytestmark = pytest.mark.e2e


wait_for = functools.partial(_wait_for, every=0.3)  # local processes: poll a little faster


def get_json(cluster, *args) -> dict | None:
    out = cluster.kubectl("get", *args, "-o", "json")
    if out.returncode != 0:
        return None
    return json.loads(out.stdout)


def ready(pod: dict) -> bool:
    return any(c["type"] == "Ready" and c["status"] == "True" for c in pod["status"].get("conditions", []))


WEB = """
apiVersion: v1
kind: Pod
metadata: {name: web, namespace: default, labels: {app: web}}
spec:
  containers:
  - name: server
    image: unused
    command: ["python", "-m", "http.server", "--bind", "$(POD_IP)", "8080"]
    env:
    - name: POD_IP
      valueFrom: {fieldRef: {fieldPath: status.podIP}}
    ports: [{name: http, containerPort: 8080}]
    readinessProbe:
      httpGet: {path: /, port: http}
      periodSeconds: 1
---
apiVersion: v1
kind: Service
metadata: {name: web, namespace: default}
spec:
  selector: {app: web}
  ports: [{name: http, port: 80, targetPort: http}]
"""


def test_http_pod_ready_reachable_and_killed_on_delete(cluster):
    cluster.kubectl("apply", "-f", "-", input=WEB, check=True)
    pod = wait_for(lambda: (lambda p: p if p and ready(p) else None)(get_json(cluster, "pod", "web")),
                   60, "pod web Ready")
    ip = ipaddress.ip_address(pod["status"]["podIP"])
    assert ip.is_loopback and str(ip) != "127.0.0.1"
    status = pod["status"]["containerStatuses"][0]
    assert status["ready"] and "running" in status["state"]
    pid = int(status["containerID"].removeprefix("anneal-local://"))
    assert Path(f"/proc/{pid}").exists()

    slices = get_json(cluster, "endpointslices", "-l", "kubernetes.io/service-name=web")["items"]
    assert [(s["addressType"], s["endpoints"][0]["addresses"]) for s in slices] == [("FQDN", [str(ip)])]
    url = cluster.service_url("web", "default", "http")
    assert url == f"http://{ip}:8080"
    assert httpx.get(url, timeout=5).status_code == 200

    cluster.kubectl("delete", "pod", "web", "--wait=true", "--timeout=60s", check=True)
    assert get_json(cluster, "pod", "web") is None
    wait_for(lambda: not procs.group_alive(pid), 10, "the server's process group to exit")
    cluster.kubectl("delete", "service", "web", check=True)


JOB = """
apiVersion: v1
kind: ConfigMap
metadata: {name: job-config, namespace: default}
data: {greeting.txt: "hello from a configmap"}
---
apiVersion: v1
kind: Secret
metadata: {name: job-secret, namespace: default}
stringData: {token: s3cret}
---
apiVersion: batch/v1
kind: Job
metadata: {name: report, namespace: default}
spec:
  backoffLimit: 0
  template:
    spec:
      restartPolicy: Never
      volumes:
      - name: cfg
        configMap: {name: job-config}
      containers:
      - name: main
        image: unused
        command: ["python", "-c"]
        args:
        - |
          import os, sys
          print("greeting:", open("/etc/report/greeting.txt").read())
          print("pod:", os.environ["POD_NAME"], os.environ["POD_NS"])
          print("token:", os.environ["TOKEN"])
          print("kubeconfig:", os.path.exists(os.environ.get("KUBECONFIG", "/nonexistent")))
          print("anneal:", os.path.exists(os.path.join(os.path.dirname(sys.executable), "anneal")))
        env:
        - {name: POD_NAME, valueFrom: {fieldRef: {fieldPath: metadata.name}}}
        - {name: POD_NS, valueFrom: {fieldRef: {fieldPath: metadata.namespace}}}
        - {name: TOKEN, valueFrom: {secretKeyRef: {name: job-secret, key: token}}}
        volumeMounts:
        - {name: cfg, mountPath: /etc/report}
"""


def test_job_runs_to_succeeded_with_env_and_volumes(cluster):
    cluster.kubectl("apply", "-f", "-", input=JOB, check=True)
    job = wait_for(lambda: (lambda j: j if j and j.get("status", {}).get("succeeded") == 1 else None)(
        get_json(cluster, "job", "report")), 90, "job report to succeed")
    assert not job["status"].get("failed")
    pods = get_json(cluster, "pods", "-l", "job-name=report")["items"]
    assert [p["status"]["phase"] for p in pods] == ["Succeeded"]
    name = pods[0]["metadata"]["name"]
    out = cluster.pod_log("default", name)
    assert "greeting: hello from a configmap" in out
    assert f"pod: {name} default" in out
    assert "token: s3cret" in out
    assert "kubeconfig: True" in out  # the service-account token became a kubeconfig
    assert "anneal: True" in out  # the venv's bin is on PATH
    cluster.kubectl("delete", "job", "report", "--cascade=foreground", "--wait=false")


FAILING = """
apiVersion: v1
kind: Pod
metadata: {name: flaky, namespace: default}
spec:
  restartPolicy: OnFailure
  containers:
  - name: main
    image: unused
    command: ["sh", "-c", "n=$(cat $HOME/n 2>/dev/null || echo 0); echo $((n+1)) > $HOME/n; [ $n -ge 2 ]"]
"""


def test_restart_policy_restarts_until_success(cluster):
    cluster.kubectl("apply", "-f", "-", input=FAILING, check=True)
    pod = wait_for(lambda: (lambda p: p if p and p["status"].get("phase") == "Succeeded" else None)(
        get_json(cluster, "pod", "flaky")), 60, "pod flaky to succeed after restarts")
    assert pod["status"]["containerStatuses"][0]["restartCount"] == 2
    cluster.kubectl("delete", "pod", "flaky", "--wait=false")


def test_stop_leaves_no_processes(tmp_path):
    c = LocalCluster(tmp_path / "c", gpu_nodes=1).start()
    try:
        c.kubectl("run", "sleeper", "--image=unused", "--", "sh", "-c", "sleep 300 & sleep 300", check=True)
        pod = wait_for(lambda: (lambda p: p if p and p["status"].get("phase") == "Running" else None)(
            get_json(c, "pod", "sleeper")), 60, "sleeper Running")
        pid = int(pod["status"]["containerStatuses"][0]["containerID"].removeprefix("anneal-local://"))
        assert Path(f"/proc/{pid}").exists()
        assert len(procs.marked(c.cluster_id)) >= 8  # etcd, apiserver, kcm, scheduler, kwok, runner + the pod's 3
    finally:
        c.stop()
    assert procs.marked(c.cluster_id) == []
    assert not procs.group_alive(pid)
    assert os.path.exists(tmp_path / "c" / "logs" / "kube-apiserver.log")


STARTER = """
import sys, time
sys.path.insert(0, {e2e!r})
from cluster import LocalCluster
c = LocalCluster({state!r}, gpu_nodes=0).start()
c.kubectl("run", "sleeper", "--image=unused", "--", "sleep", "300", check=True)
print(c.cluster_id, flush=True)
time.sleep(600)
"""


def test_killed_test_run_leaves_no_processes(tmp_path):
    """A test run killed with SIGKILL (no atexit, no fixture teardown) takes its cluster with it."""
    import signal
    import subprocess

    code = STARTER.format(e2e=str(Path(__file__).resolve().parent), state=str(tmp_path / "c"))
    parent = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        cluster_id = parent.stdout.readline().strip()
        assert cluster_id, "the cluster did not start"
        wait_for(lambda: any("sleep" in Path(f"/proc/{p}/cmdline").read_text()
                             for p in procs.marked(cluster_id) if Path(f"/proc/{p}").exists()),
                 30, "the pod's process")
    finally:
        parent.send_signal(signal.SIGKILL)
        parent.wait()
    wait_for(lambda: procs.marked(cluster_id) == [], 30, "every process of the cluster to exit")


WATCHER = """
apiVersion: v1
kind: ConfigMap
metadata: {name: live, namespace: default}
data: {value: one}
---
apiVersion: v1
kind: Pod
metadata: {name: watcher, namespace: default}
spec:
  volumes:
  - {name: live, configMap: {name: live}}
  - {name: tmp, emptyDir: {}}
  containers:
  - name: main
    image: unused
    command: ["sh", "-c", "echo tmp=$TMPDIR; while true; do cat /etc/live/value; echo; sleep 0.3; done"]
    volumeMounts:
    - {name: live, mountPath: /etc/live}
    - {name: tmp, mountPath: /tmp}
"""


def test_mounted_configmap_follows_updates(cluster):
    cluster.kubectl("apply", "-f", "-", input=WATCHER, check=True)
    try:
        wait_for(lambda: "one" in cluster.pod_log("default", "watcher"), 60, "the first value")
        cluster.kubectl("patch", "configmap", "live", "-p", '{"data": {"value": "two"}}', check=True)
        wait_for(lambda: "two" in cluster.pod_log("default", "watcher"), 30, "the updated value")
        first = cluster.pod_log("default", "watcher").splitlines()[0]
        assert first.startswith("tmp=") and first.endswith("/volumes/tmp")  # /tmp mount → TMPDIR
    finally:
        cluster.kubectl("delete", "pod/watcher", "configmap/live", "--wait=false")


INIT = """
apiVersion: v1
kind: Pod
metadata: {name: with-init, namespace: default}
spec:
  restartPolicy: Never
  volumes: [{name: shared, emptyDir: {}}]
  initContainers:
  - name: prepare
    image: unused
    command: ["sh", "-c", "echo prepared > /work/ready"]
    volumeMounts: [{name: shared, mountPath: /work}]
  containers:
  - name: main
    image: unused
    command: ["cat", "/work/ready"]
    volumeMounts: [{name: shared, mountPath: /work}]
"""


def test_init_container_runs_first(cluster):
    cluster.kubectl("apply", "-f", "-", input=INIT, check=True)
    try:
        pod = wait_for(lambda: (lambda p: p if p and p["status"].get("phase") in ("Succeeded", "Failed") else None)(
            get_json(cluster, "pod", "with-init")), 60, "with-init to finish")
        assert pod["status"]["phase"] == "Succeeded", cluster.pod_log("default", "with-init")
        assert pod["status"]["initContainerStatuses"][0]["state"]["terminated"]["exitCode"] == 0
        assert cluster.pod_log("default", "with-init", "main") == "prepared\n"
    finally:
        cluster.kubectl("delete", "pod", "with-init", "--wait=false")


PROBED = """
apiVersion: v1
kind: Pod
metadata: {name: slow-start, namespace: default}
spec:
  containers:
  - name: main
    image: unused
    command: ["sh", "-c", "sleep 2; touch $HOME/up; sleep 300"]
    startupProbe:
      exec: {command: ["sh", "-c", "test -f $HOME/up"]}
      periodSeconds: 1
      failureThreshold: 20
    livenessProbe:  # would fail at once, were it not gated by the startup probe
      exec: {command: ["sh", "-c", "test -f $HOME/up"]}
      periodSeconds: 1
      failureThreshold: 1
---
apiVersion: v1
kind: Pod
metadata: {name: bad-model, namespace: default}
spec:
  restartPolicy: Never
  containers:
  - name: main
    image: unused
    command: ["sh", "-c", "echo loading; echo 'error: model path /models/x not found' >&2; exit 3"]
    terminationMessagePolicy: FallbackToLogsOnError
"""


def test_startup_probe_gates_liveness_and_failure_message_from_logs(cluster):
    cluster.kubectl("apply", "-f", "-", input=PROBED, check=True)
    try:
        pod = wait_for(lambda: (lambda p: p if p and ready(p) else None)(get_json(cluster, "pod", "slow-start")),
                       60, "slow-start Ready")
        st = pod["status"]["containerStatuses"][0]
        assert st["started"] is True and st["restartCount"] == 0
        bad = wait_for(lambda: (lambda p: p if p and p["status"].get("phase") == "Failed" else None)(
            get_json(cluster, "pod", "bad-model")), 60, "bad-model Failed")
        term = bad["status"]["containerStatuses"][0]["state"]["terminated"]
        assert term["exitCode"] == 3 and "model path /models/x not found" in term["message"]
    finally:
        cluster.kubectl("delete", "pod", "slow-start", "bad-model", "--wait=false")
