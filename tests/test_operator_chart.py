"""The Helm chart, the rendered install.yaml and the examples. Rendering needs a helm binary
($HELM, PATH, or the e2e build's ~/.cache/anneal/k8s-bin/*/helm); those tests skip without one."""

from __future__ import annotations

import glob
import os
import shutil
import subprocess
from pathlib import Path

import jsonschema
import pytest
import yaml

from anneal.engine.traffic import parse_traffic
from anneal.operator import crdgen
from anneal.operator.api import CompilationJobSpec, InferenceDeploymentSpec
from anneal.operator.api.resources import COMPILATION_JOB, INFERENCE_DEPLOYMENT

REPO = Path(__file__).resolve().parent.parent
CHART = REPO / "charts" / "anneal"


def _helm() -> str | None:
    found = os.environ.get("HELM") or shutil.which("helm")
    if not found:
        cached = sorted(glob.glob(str(Path.home() / ".cache" / "anneal" / "k8s-bin" / "*" / "helm")))
        found = cached[-1] if cached else None
    return found


HELM = _helm()
needs_helm = pytest.mark.skipif(HELM is None, reason="no helm binary")


def _examples():
    for path in sorted((REPO / "manifests" / "examples").glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc:
                yield path.name, doc


@pytest.mark.parametrize("name,doc", list(_examples()), ids=lambda v: v if isinstance(v, str) else v["metadata"]["name"])
def test_examples_are_valid(name, doc):
    if doc["kind"] not in ("InferenceDeployment", "CompilationJob"):
        return
    resource = INFERENCE_DEPLOYMENT if doc["kind"] == "InferenceDeployment" else COMPILATION_JOB
    schema = crdgen.crd(resource)["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    jsonschema.Draft4Validator(schema).validate(doc)
    model = InferenceDeploymentSpec if doc["kind"] == "InferenceDeployment" else CompilationJobSpec
    spec = model.model_validate(doc["spec"])
    if doc["kind"] == "CompilationJob" and spec.traffic.shape is not None:
        parse_traffic(spec.traffic.shape)  # the coordinator must be able to read it


def test_dockerfiles_keep_the_operator_image_torch_free():
    text = (REPO / "docker" / "operator.Dockerfile").read_text()
    assert '".[operator]"' in text and "engine]" not in text and "find_spec('torch')" in text
    engine = (REPO / "docker" / "engine.Dockerfile").read_text()
    assert "USER 10001" in engine and "ENTRYPOINT [\"anneal\"]" in engine


def _template(*args: str) -> list[dict]:
    env = dict(os.environ, HELM_CACHE_HOME="/tmp/anneal-helm-cache", HELM_CONFIG_HOME="/tmp/anneal-helm-config")
    out = subprocess.run([HELM, "template", "anneal", str(CHART), "--namespace", "anneal-system", "--kube-version", "1.29.0", *args],
                         capture_output=True, text=True, env=env)
    assert out.returncode == 0, out.stderr
    return [d for d in yaml.safe_load_all(out.stdout) if d]


@needs_helm
def test_helm_lint_is_clean():
    env = dict(os.environ, HELM_CACHE_HOME="/tmp/anneal-helm-cache", HELM_CONFIG_HOME="/tmp/anneal-helm-config")
    out = subprocess.run([HELM, "lint", "--strict", str(CHART)], capture_output=True, text=True, env=env)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "[WARNING]" not in out.stdout and "[ERROR]" not in out.stdout, out.stdout


@needs_helm
def test_default_render_is_cluster_wide_with_minimal_rbac():
    docs = _template()
    kinds = sorted(d["kind"] for d in docs)
    assert kinds == sorted(["ServiceAccount", "ClusterRole", "ClusterRole", "ClusterRoleBinding", "ClusterRoleBinding",
                            "Deployment", "ClusterKopfPeering"])
    for role in (d for d in docs if d["kind"] == "ClusterRole"):
        for rule in role["rules"]:
            assert "*" not in rule["verbs"] and "*" not in rule["resources"], rule
            if "secrets" in rule["resources"]:
                assert set(rule["verbs"]) == {"get", "create"}  # never list or watch Secrets
    dep = next(d for d in docs if d["kind"] == "Deployment")
    c = dep["spec"]["template"]["spec"]["containers"][0]
    assert c["command"] == ["python", "-m", "anneal.operator"]
    assert c["securityContext"]["readOnlyRootFilesystem"] is True
    assert c["livenessProbe"]["httpGet"]["path"] == "/healthz"
    env = {e["name"]: e.get("value") for e in c["env"]}
    assert env["ANNEAL_PEERING_NAME"] == "anneal" and env["ANNEAL_WATCH_NAMESPACES"] == ""


@needs_helm
def test_watched_namespaces_get_role_bindings_and_peerings():
    docs = _template("--set", "watchNamespaces={ml,research}", "--set", "prometheus.url=http://prom:9090")
    bindings = [d for d in docs if d["kind"] == "RoleBinding"]
    assert sorted(b["metadata"]["namespace"] for b in bindings) == ["ml", "research"]
    assert sorted(d["metadata"]["namespace"] for d in docs if d["kind"] == "KopfPeering") == ["ml", "research"]
    assert sum(d["kind"] == "ClusterRoleBinding" for d in docs) == 1  # only the cluster-scoped reads
    env = {e["name"]: e.get("value") for e in next(d for d in docs if d["kind"] == "Deployment")
           ["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert env["ANNEAL_WATCH_NAMESPACES"] == "ml,research" and env["ANNEAL_PROMETHEUS_URL"] == "http://prom:9090"


@needs_helm
def test_values_schema_rejects_bad_values():
    env = dict(os.environ, HELM_CACHE_HOME="/tmp/anneal-helm-cache", HELM_CONFIG_HOME="/tmp/anneal-helm-config")
    out = subprocess.run([HELM, "template", "anneal", str(CHART), "--kube-version", "1.29.0", "--set", "operator.logLevel=LOUD"],
                         capture_output=True, text=True, env=env)
    assert out.returncode != 0 and "logLevel" in out.stderr


@needs_helm
def test_install_yaml_is_rendered_from_the_chart():
    out = subprocess.run([str(REPO / "scripts" / "render-manifests"), "--check"], capture_output=True, text=True,
                         env=dict(os.environ, HELM=HELM))
    assert out.returncode == 0, out.stderr
    docs = [d for d in yaml.safe_load_all((REPO / "manifests" / "install.yaml").read_text()) if d]
    kinds = [d["kind"] for d in docs]
    assert kinds[0] == "Namespace" and kinds.count("CustomResourceDefinition") == 4
