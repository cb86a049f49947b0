"""The Anneal chart on a test cluster: install the operator for one test module, and take it away
again so the next module starts from a cluster without a controller.

Why the teardown matters: every module shares one cluster per session. An operator left running
by a module keeps reconciling every namespace (the chart watches all of them by default): it
overwrites the status that later modules write by hand (the schema tests set a CompilationJob's
phase to `Searching` to check that its spec freezes) and keeps the earlier module's engine pods
crash-looping on the runner node, on a machine with few cores.

`uninstall_operator` deletes the module's namespaces first, *while the operator still runs*, so
it releases the finalizers it put on its resources (a namespace whose CompilationJob keeps
`anneal.dev/finalizer` with no operator left would never go away), then `helm uninstall`s the
release and waits until the operator's pods are gone (the runner has killed their processes).
"""

from __future__ import annotations

import json
import time

RELEASE = "anneal"
OPERATOR_NS = "anneal-system"
OPERATOR_SELECTOR = "app.kubernetes.io/name=anneal-operator"
MODULE_LABEL = "anneal.dev/e2e-module"


def operator_pods(cluster, namespace: str | None = None) -> list[dict]:
    """The operator's pods (not already being deleted) in `namespace`, or in every namespace."""
    where = ["-n", namespace] if namespace else ["--all-namespaces"]
    out = cluster.kubectl("get", "pods", *where, "-l", OPERATOR_SELECTOR, "-o", "json")
    if out.returncode != 0:
        raise AssertionError(f"kubectl get pods: {out.stderr}")
    return [p for p in json.loads(out.stdout)["items"] if not p["metadata"].get("deletionTimestamp")]


def any_operator_pods(cluster) -> list[str]:
    """Names (namespace/name) of every operator pod that still exists, terminating ones included."""
    out = cluster.kubectl("get", "pods", "--all-namespaces", "-l", OPERATOR_SELECTOR, "-o", "json")
    if out.returncode != 0:
        raise AssertionError(f"kubectl get pods: {out.stderr}")
    return [f"{p['metadata']['namespace']}/{p['metadata']['name']}" for p in json.loads(out.stdout)["items"]]


def module_namespace(cluster, name: str, module: str) -> str:
    """Create (or keep) namespace `name`, labelled as `module`'s so its teardown can delete it."""
    obj = {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name, "labels": {MODULE_LABEL: module}}}
    out = cluster.kubectl("apply", "-f", "-", input=json.dumps(obj))
    assert out.returncode == 0, out.stderr
    return name


def install_operator(cluster, *helm_args: str, timeout: str = "180s") -> None:
    """`helm upgrade --install` the chart into anneal-system, the operator on the runner node."""
    from pathlib import Path

    chart = Path(__file__).resolve().parents[2] / "charts" / "anneal"
    out = cluster.helm(
        "upgrade", "--install", RELEASE, str(chart), "-n", OPERATOR_NS, "--create-namespace",
        "--set-string", "operator.nodeSelector.anneal\\.dev/local-exec=true",
        *helm_args, "--wait", "--timeout", timeout,
    )
    assert out.returncode == 0, out.stdout + out.stderr


def wait_until_no_operator(cluster, timeout: float = 150) -> None:
    """Wait until no operator pod exists anywhere; fail, naming them, if some outlive `timeout`."""
    deadline = time.monotonic() + timeout
    left = any_operator_pods(cluster)
    while left and time.monotonic() < deadline:
        time.sleep(1)
        left = any_operator_pods(cluster)
    if left:
        raise AssertionError(
            f"operator pods still exist after {timeout:.0f}s: {left}. An earlier module installed the chart and did "
            "not uninstall it (use cluster.operator_chart.uninstall_operator in its fixture's teardown)")


def uninstall_operator(cluster, module: str | None = None, namespaces: tuple[str, ...] = (),
                       timeout: float = 180) -> None:
    """Delete the module's namespaces (those labelled `module`, and `namespaces`) while the
    operator still runs, then uninstall the release and wait until the operator's pods are gone."""
    t0 = time.monotonic()
    targets = []
    if module:
        out = cluster.kubectl("get", "namespaces", "-l", f"{MODULE_LABEL}={module}", "-o", "name")
        targets += [n.split("/", 1)[1] for n in out.stdout.split() if n]
    targets += [n for n in namespaces if n not in targets]
    if targets:
        out = cluster.kubectl("delete", "namespace", *targets, "--ignore-not-found", f"--timeout={int(timeout)}s",
                              timeout=timeout + 30)
        if out.returncode != 0:
            # not fatal for later modules (they use their own namespaces); say what was left
            print(f"namespaces {targets} not deleted within {timeout:.0f}s: {out.stderr.strip()}")
    out = cluster.helm("uninstall", RELEASE, "-n", OPERATOR_NS, "--ignore-not-found", "--wait",
                       "--timeout", f"{int(timeout)}s", timeout=timeout + 30)
    assert out.returncode == 0, out.stdout + out.stderr
    wait_until_no_operator(cluster, timeout)
    print(f"operator uninstalled, namespaces {targets} deleted in {time.monotonic() - t0:.0f}s")
