"""The e2e suite's fixtures: one real local control plane per test session.

`cluster` (session-scoped) builds the binaries if needed (cached after the first build), starts
etcd, kube-apiserver, controller manager, scheduler, kwok with fake GPU nodes and the local runner,
and yields the `LocalCluster`:
  .kubeconfig                      path of an admin kubeconfig
  .kubectl(*args, input=None)      -> subprocess.CompletedProcess (text)
  .helm(*args)                     -> subprocess.CompletedProcess (text)
  .api()                           -> kubernetes.client.ApiClient
  .service_url(name, namespace, port) -> "http://<pod ip>:<port>" of a ready local pod
  .pod_log(namespace, name, container=None) -> what a runner pod's process printed
                                     (`kubectl logs` works too)
Nodes: `kwok-gpu-0`, `kwok-gpu-1` (8 `nvidia.com/gpu` each, tainted; pods requesting GPUs tolerate
it automatically; nothing runs there) and `anneal-local` (label `anneal.dev/local-exec=true`) where
every other pod runs as local processes: bind to $(POD_IP) (from the downward API), see
cluster/runner.py and cluster/podspec.py for what the runner does with a pod spec.
Every test under e2e/ is marked `e2e`. ANNEAL_E2E_GPU_NODES changes the number of GPU nodes.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from cluster import LocalCluster  # noqa: E402


def pytest_collection_modifyitems(config, items):
    here = Path(__file__).resolve().parent
    for item in items:
        if here in Path(str(item.fspath)).resolve().parents:
            item.add_marker(pytest.mark.e2e)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A failed test's report carries what its module's ``operator_log(funcargs)`` returns (the
    operator's log tail). Why: session 11's CI lost an engine-restart wait under load and the
    report held nothing to read; the log printed at the module's teardown is not shown then."""
    outcome = yield
    rep = outcome.get_result()
    log = getattr(item.module, "operator_log", None)
    if rep.when == "call" and rep.failed and log is not None:
        try:
            text = log(item.funcargs)
        except Exception as e:  # noqa: BLE001 - a report must not fail for want of a log
            text = f"(no operator log: {type(e).__name__}: {e})"
        rep.sections.append(("operator log (tail, without HTTP requests)", text))


@pytest.fixture(scope="session")
def cluster(tmp_path_factory):
    state = tmp_path_factory.mktemp("cluster")
    gpu_nodes = int(os.environ.get("ANNEAL_E2E_GPU_NODES", "2"))
    c = LocalCluster(state, gpu_nodes=gpu_nodes).start()
    try:
        yield c
    finally:
        c.stop()
