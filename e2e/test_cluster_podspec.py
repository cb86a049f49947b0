"""The runner's pure parts: env expansion, mount-path rewriting, downward API, IPs, probe counting.

These need no cluster (no `cluster` fixture), so they run in a second.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from cluster.podspec import ConfigError, PodContext, expand, field_value  # noqa: E402
from cluster.probes import ProbeState  # noqa: E402
from cluster.runner import IpPool, claim_block  # noqa: E402

POD = {"metadata": {"name": "p", "namespace": "ns", "uid": "u1", "labels": {"app": "web"}},
       "spec": {"nodeName": "anneal-local", "serviceAccountName": "sa", "containers": [{"name": "c"}]}}


def test_expand_follows_kubernetes_rules():
    env = {"A": "1", "B": "two"}
    assert expand("x$(A)y$(B)", env) == "x1ytwo"
    assert expand("$(MISSING)", env) == "$(MISSING)"
    assert expand("$$(A)", env) == "$(A)"
    assert expand("$(cat f || echo 0) $((n+1))", env) == "$(cat f || echo 0) $((n+1))"


def test_field_refs():
    assert field_value(POD, "metadata.name", "127.1.0.2") == "p"
    assert field_value(POD, "metadata.namespace", "127.1.0.2") == "ns"
    assert field_value(POD, "status.podIP", "127.1.0.2") == "127.1.0.2"
    assert field_value(POD, "metadata.labels['app']", "") == "web"
    with pytest.raises(ConfigError):
        field_value(POD, "spec.bogus", "")


def test_volumes_and_env_from_api_objects(tmp_path):
    objects = {
        "/api/v1/namespaces/ns/configmaps/cfg": {"data": {"plan.json": "{}", "mode": "fast"}},
        "/api/v1/namespaces/ns/secrets/sec": {"data": {"key": "czNjcmV0"}},  # base64("s3cret")
    }
    pod = {**POD, "spec": {**POD["spec"], "volumes": [{"name": "plan", "configMap": {"name": "cfg"}}]}}
    ctx = PodContext(pod, tmp_path, "127.1.0.9", objects.get, lambda src: "tok", "https://127.0.0.1:6443",
                     {"PATH": "/bin"})
    ctx.materialize_volumes()
    container = {"name": "c", "command": ["serve", "--plan=/etc/plan/plan.json", "/etc/planner"],
                 "volumeMounts": [{"name": "plan", "mountPath": "/etc/plan"}],
                 "env": [{"name": "MODE", "valueFrom": {"configMapKeyRef": {"name": "cfg", "key": "mode"}}},
                         {"name": "KEY", "valueFrom": {"secretKeyRef": {"name": "sec", "key": "key"}}},
                         {"name": "IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
                         {"name": "URL", "value": "http://$(IP):8000"}]}
    mounts = ctx.mounts(container)
    env = ctx.env(container, mounts)
    assert (env["MODE"], env["KEY"], env["URL"]) == ("fast", "s3cret", "http://127.1.0.9:8000")
    assert env["KUBERNETES_SERVICE_HOST"] == "127.0.0.1" and env["KUBERNETES_SERVICE_PORT"] == "6443"
    argv = ctx.argv(container, env, mounts)
    local = tmp_path / "volumes" / "plan"
    assert argv == ["serve", f"--plan={local}/plan.json", "/etc/planner"]  # a prefix of a longer name stays
    assert (local / "plan.json").read_text() == "{}"
    two = {"/etc/plan": "/tmp/pod/volumes/plan", "/tmp": "/tmp/pod/volumes/tmp"}
    assert ctx.rewrite("cat /etc/plan/x /tmp/y /var/tmp/z /tmpfoo", two) == \
        "cat /tmp/pod/volumes/plan/x /tmp/pod/volumes/tmp/y /var/tmp/z /tmpfoo"

    objects["/api/v1/namespaces/ns/configmaps/cfg"] = {"data": {"plan.json": '{"v": 2}', "mode": "fast"}}
    ctx.materialize_volumes(refresh=True)  # a changed ConfigMap reaches the mounted file
    assert (local / "plan.json").read_text() == '{"v": 2}'

    missing = {"name": "c", "command": ["x"], "env": [
        {"name": "K", "valueFrom": {"secretKeyRef": {"name": "nope", "key": "k"}}}]}
    with pytest.raises(ConfigError, match="not found"):
        ctx.env(missing, {})
    with pytest.raises(ConfigError, match="no command or args"):
        ctx.argv({"name": "c"}, env, mounts)


def test_ip_pool_hands_out_distinct_loopback_ips_and_reuses():
    pool = IpPool(7)
    ips = [pool.take() for _ in range(300)]
    assert len(set(ips)) == 300
    assert all(ip.startswith("127.7.") and not ip.endswith((".0", ".255")) for ip in ips)
    with pytest.raises(ValueError):
        IpPool(0)
    pool.release(ips[0])
    assert ips[0] not in [pool.take() for _ in range(10)]  # handed out in order, not immediately reused


def test_parallel_clusters_claim_different_loopback_blocks(tmp_path):
    a, lock_a = claim_block(tmp_path)
    b, lock_b = claim_block(tmp_path)
    assert (a, b) == (1, 2)  # the first block is held, so the second cluster gets the next one
    lock_a.close()  # that runner is gone: its block is free again
    c, lock_c = claim_block(tmp_path)
    assert c == 1
    lock_b.close(), lock_c.close()


def test_probe_thresholds():
    st = ProbeState({"periodSeconds": 1, "successThreshold": 2, "failureThreshold": 2}, started=0.0)
    assert st.due(0.0)
    assert st.record(True, 0.0) is False  # one success is not enough
    assert not st.due(0.5) and st.due(1.0)
    assert st.record(True, 1.0) is True
    assert st.record(False, 2.0) is True  # one failure is not enough
    assert st.record(False, 3.0) is False
