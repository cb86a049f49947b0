"""The generated CRDs: up to date, structural, and their schemas agree with the pydantic models."""

from __future__ import annotations

import copy
import subprocess
import sys

import jsonschema
import pytest
import yaml

from anneal.operator import crdgen
from anneal.operator.api import InferenceDeploymentSpec, CompilationJobSpec
from anneal.operator.api.resources import RESOURCES


def _walk(node, path="$"):
    yield path, node
    for name, sub in (node.get("properties") or {}).items():
        yield from _walk(sub, f"{path}.{name}")
    if isinstance(node.get("items"), dict):
        yield from _walk(node["items"], f"{path}[]")
    if isinstance(node.get("additionalProperties"), dict):
        yield from _walk(node["additionalProperties"], f"{path}{{}}")


def test_crds_directory_is_up_to_date():
    stale = crdgen.stale_files()
    assert not stale, f"run `python -m anneal.operator.crdgen --write`; stale: {stale}"


def test_check_command_fails_on_a_stale_file(tmp_path, monkeypatch):
    monkeypatch.setattr(crdgen, "OUTPUT_DIRS", (tmp_path,))
    assert crdgen.main(["--check"]) == 1
    assert crdgen.main(["--write"]) == 0
    assert crdgen.main(["--check"]) == 0
    path = next(tmp_path.iterdir())
    path.write_text(path.read_text() + "# hand edit\n")
    assert crdgen.main(["--check"]) == 1


def test_print_matches_files_and_parses():
    docs = [d for d in yaml.safe_load_all(crdgen.render_all())]
    assert [d["spec"]["names"]["kind"] for d in docs] == ["InferenceDeployment", "CompilationJob"]
    assert docs[0]["spec"]["names"]["shortNames"] == ["infdep", "idep"]
    assert docs[1]["spec"]["names"]["shortNames"] == ["cjob"]


@pytest.mark.parametrize("resource", RESOURCES, ids=lambda r: r.kind)
def test_schema_is_structural(resource):
    root = crdgen.crd(resource)["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    for path, node in _walk(root):
        for banned in ("$ref", "$defs", "anyOf", "oneOf", "allOf", "nullable", "title", "const"):
            assert banned not in node, f"{path} has {banned}"
        if not (node.get("x-kubernetes-int-or-string") or node.get("x-kubernetes-preserve-unknown-fields")):
            assert "type" in node, f"{path} has no type"
        if "properties" in node:
            assert "additionalProperties" not in node, path
        if isinstance(node.get("exclusiveMinimum"), (int, float)) and not isinstance(node.get("exclusiveMinimum"), bool):
            pytest.fail(f"{path}: numeric exclusiveMinimum is not OpenAPI v3.0")
        if path != "$.metadata" and not path.endswith(("[]", "{}")):
            assert node.get("description"), f"{path} has no description (kubectl explain)"


@pytest.mark.parametrize("resource", RESOURCES, ids=lambda r: r.kind)
def test_defaults_validate_against_their_schema(resource):
    root = crdgen.crd(resource)["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    for path, node in _walk(root):
        if "default" in node:
            jsonschema.Draft4Validator(node).validate(node["default"])


def test_status_subresource_printer_columns_and_freeze_rule():
    idep, cjob = crdgen.crds()
    for obj in (idep, cjob):
        version = obj["spec"]["versions"][0]
        assert version["subresources"] == {"status": {}}
        names = [c["name"] for c in version["additionalPrinterColumns"]]
        assert {"Phase", "Plan", "Age"} <= set(names)
    cols = {c["name"]: c["jsonPath"] for c in cjob["spec"]["versions"][0]["additionalPrinterColumns"]}
    assert cols["Speedup"] == ".status.bestSpeedup" and cols["Experiments"] == ".status.experiments"
    rules = [r["rule"] for r in cjob["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["x-kubernetes-validations"]]
    assert any("oldSelf.status.phase" in r and "self.spec == oldSelf.spec" in r for r in rules)


def test_api_server_defaults_equal_pydantic_defaults():
    """What the API server fills in must be what the models assume."""
    for model, resource in ((InferenceDeploymentSpec, RESOURCES[0]), (CompilationJobSpec, RESOURCES[1])):
        schema = crdgen.crd(resource)["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
        minimal = {"model": "random:tiny"} if model is InferenceDeploymentSpec else {"target": {"model": "random:tiny"}}
        defaulted = _apply_defaults(copy.deepcopy(minimal), schema)
        assert model.model_validate(defaulted).wire() == model.model_validate(minimal).wire()


def _apply_defaults(obj, schema):
    """Structural defaulting as the API server does it (objects and their properties)."""
    if isinstance(obj, dict):
        for name, sub in (schema.get("properties") or {}).items():
            if name not in obj and "default" in sub:
                obj[name] = copy.deepcopy(sub["default"])
            if name in obj:
                obj[name] = _apply_defaults(obj[name], sub)
    elif isinstance(obj, list) and isinstance(schema.get("items"), dict):
        obj = [_apply_defaults(x, schema["items"]) for x in obj]
    return obj


def test_anneal_crds_cli_prints_yaml():
    out = subprocess.run(
        [sys.executable, "-m", "anneal.operator.crdgen"], capture_output=True, text=True, check=True
    ).stdout
    assert out == crdgen.render_all()
