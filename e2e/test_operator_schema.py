"""The CRDs on a real API server: applied by kubectl, every resource of the invalid corpus refused,
valid ones and the shipped examples accepted, a started CompilationJob's spec frozen, printer
columns served."""

from __future__ import annotations

import importlib.util
import json
import time
from pathlib import Path

import pytest
import yaml

from cluster import operator_chart as chart

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parent.parent
NS = "anneal-schema"


def _corpus():
    spec = importlib.util.spec_from_file_location("crd_corpus", REPO / "tests" / "test_crds_invalid.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


CORPUS = _corpus()


@pytest.fixture(scope="module")
def crds(cluster):
    """The CRDs of crds/ applied by kubectl, on a cluster where no operator runs: these tests write
    a CompilationJob's status by hand (phase Searching, printer-column values) and a running
    operator would rewrite it under them. A module that installed the chart uninstalls it in its
    teardown; this waits for its pod to be gone and fails, naming it, if one is left."""
    chart.wait_until_no_operator(cluster)
    # --force-conflicts: the chart (helm, an earlier module) may have created these CRDs; the
    # schema under test is crds/ as it is now
    out = cluster.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(REPO / "crds"))
    assert out.returncode == 0, out.stderr
    for name in ("inferencedeployments.anneal.dev", "compilationjobs.anneal.dev"):
        done = cluster.kubectl("wait", "--for=condition=Established", f"crd/{name}", "--timeout=60s")
        assert done.returncode == 0, done.stderr
    chart.module_namespace(cluster, NS, "operator-schema")
    yield cluster
    cluster.kubectl("delete", "namespace", NS, "--wait=false")


def _create(cluster, obj, *extra):
    obj = json.loads(json.dumps(obj))
    obj["metadata"]["namespace"] = NS
    return cluster.kubectl("create", "--validate=strict", *extra, "-f", "-", input=json.dumps(obj))


@pytest.mark.parametrize("case_id,layer,obj", CORPUS.INVALID, ids=[c[0] for c in CORPUS.INVALID])
def test_api_server_refuses_invalid_resources(crds, case_id, layer, obj):
    out = _create(crds, obj, "--dry-run=server")
    assert out.returncode != 0, f"{case_id} ({layer}) was accepted:\n{out.stdout}"
    assert "Invalid" in out.stderr or "invalid" in out.stderr or "unknown field" in out.stderr, out.stderr


@pytest.mark.parametrize("make", [CORPUS.valid_inference_deployment, CORPUS.valid_compilation_job])
def test_api_server_accepts_valid_resources(crds, make):
    out = _create(crds, make(), "--dry-run=server")
    assert out.returncode == 0, out.stderr


def test_examples_apply_as_they_are(crds):
    for path in sorted((REPO / "manifests" / "examples").glob("*.yaml")):
        out = crds.kubectl("apply", "--dry-run=server", "--validate=strict", "-n", NS, "-f", str(path))
        assert out.returncode == 0, f"{path.name}: {out.stderr}"


def test_defaults_are_applied_by_the_api_server(crds):
    obj = {"apiVersion": "anneal.dev/v1alpha1", "kind": "InferenceDeployment",
           "metadata": {"name": "defaults"}, "spec": {"model": "random:tiny"}}
    out = _create(crds, obj, "--dry-run=server", "-o", "json")
    assert out.returncode == 0, out.stderr
    spec = json.loads(out.stdout)["spec"]
    assert spec["replicas"] == 1 and spec["gpus"] == 1
    assert spec["compilation"]["mode"] == "preview"
    assert spec["compilation"]["rollout"]["canary"]["failureLimit"] == 2
    assert spec["compilation"]["search"]["agents"] == ["kernel-tuner", "plan-search", "graph-buckets", "scheduler-tuner"]


def test_compilation_job_spec_freezes_once_searching(crds):
    job = CORPUS.valid_compilation_job("freeze")
    job["spec"]["autoApply"] = False
    out = _create(crds, job)
    assert out.returncode == 0, out.stderr
    try:
        ok = crds.kubectl("patch", "cjob", "freeze", "-n", NS, "--type=merge", "-p", '{"spec":{"budget":"45m"}}')
        assert ok.returncode == 0, f"a Pending job's spec must still be editable: {ok.stderr}"
        st = crds.kubectl("patch", "cjob", "freeze", "-n", NS, "--subresource=status", "--type=merge",
                          "-p", '{"status":{"phase":"Searching"}}')
        assert st.returncode == 0, st.stderr
        frozen = crds.kubectl("patch", "cjob", "freeze", "-n", NS, "--type=merge", "-p", '{"spec":{"budget":"50m"}}')
        assert frozen.returncode != 0 and "frozen" in frozen.stderr, frozen.stderr
        # metadata (labels) may still change
        lab = crds.kubectl("label", "cjob", "freeze", "-n", NS, "team=ml")
        assert lab.returncode == 0, lab.stderr
    finally:
        crds.kubectl("delete", "cjob", "freeze", "-n", NS, "--wait=false")


def test_printer_columns_and_short_names(crds):
    obj = CORPUS.valid_compilation_job("columns")
    obj["spec"]["autoApply"] = False
    assert _create(crds, obj).returncode == 0
    try:
        crds.kubectl("patch", "cjob", "columns", "-n", NS, "--subresource=status", "--type=merge",
                     "-p", json.dumps({"status": {"phase": "Searching", "experiments": 7, "bestSpeedup": 1.42}}))
        out = crds.kubectl("get", "cjob", "columns", "-n", NS)
        assert out.returncode == 0, out.stderr
        header, row = out.stdout.splitlines()[:2]
        for col in ("TARGET", "PHASE", "EXPERIMENTS", "SPEEDUP", "PLAN", "AGE"):
            assert col in header
        assert "Searching" in row and "1.42" in row and " 7 " in f" {row} "
        explain = crds.kubectl("explain", "infdep.spec.compilation.drift.threshold")
        assert explain.returncode == 0 and "drift score" in explain.stdout, explain.stdout + explain.stderr
    finally:
        crds.kubectl("delete", "cjob", "columns", "-n", NS, "--wait=false")
