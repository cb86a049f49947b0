"""Generates the CRD YAML from the pydantic API models (`anneal crds`).

Pydantic writes JSON Schema; Kubernetes wants a *structural* OpenAPI v3 schema: no `$ref`, a
`type` on every node, `nullable`-free optionals, boolean `exclusiveMinimum`, free-form objects
marked `x-kubernetes-preserve-unknown-fields`, defaults the API server can apply. This module
does that translation, so the models stay the one source of the API.

    python -m anneal.operator.crdgen            # print all CRDs
    python -m anneal.operator.crdgen --write    # refresh crds/ and charts/anneal/crds/
    python -m anneal.operator.crdgen --check    # exit 1 when those files are stale
"""

from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel
from pydantic.json_schema import GenerateJsonSchema, NoDefault

from anneal.operator.api.base import GROUP, VERSION
from anneal.operator.api.resources import RESOURCES, Resource

REPO = Path(__file__).resolve().parent.parent
OUTPUT_DIRS = (REPO / "crds", REPO / "charts" / "anneal" / "crds")
_DROP = {"title", "additionalProperties", "discriminator", "examples", "$defs"}


class _WithFactoryDefaults(GenerateJsonSchema):
    """Also emits defaults that come from a `default_factory`, so the API server applies the
    same defaults pydantic does."""

    def get_default_value(self, schema: Any) -> Any:
        if "default_factory" in schema and not schema.get("default_factory_takes_data"):
            return schema["default_factory"]()
        return super().get_default_value(schema)

    def encode_default(self, dft: Any) -> Any:
        if isinstance(dft, BaseModel):
            return dft.model_dump(mode="json", by_alias=True, exclude_none=True)
        return super().encode_default(dft)


def _strip_nulls(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _strip_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_strip_nulls(v) for v in value]
    return value


def _minimal_default(value: Any, schema: dict[str, Any]) -> Any:
    """Drops the keys of an object default that the inner schema defaults anyway."""
    if not isinstance(value, dict) or "properties" not in schema:
        return value
    props = schema["properties"]
    out = {}
    for key, item in value.items():
        sub = props.get(key, {})
        if "default" in sub and sub["default"] == _minimal_default(item, sub):
            continue
        if "default" not in sub and item in ([], {}) and "properties" not in sub:
            continue  # an empty list or map pydantic fills anyway
        out[key] = _minimal_default(item, sub)
    return out


def _structural(node: dict[str, Any], defs: dict[str, Any]) -> dict[str, Any]:
    node = copy.deepcopy(node)
    if "$ref" in node:
        target = defs[node.pop("$ref").split("/")[-1]]
        node = {**copy.deepcopy(target), **node}
    if "anyOf" in node and not node.get("x-kubernetes-int-or-string"):
        branches = [b for b in node.pop("anyOf") if b.get("type") != "null"]
        if len(branches) != 1:
            raise ValueError(f"cannot express a union in a structural schema: {branches}")
        node = {**_structural(branches[0], defs), **node}
    if node.get("x-kubernetes-int-or-string"):
        node.pop("anyOf", None)
    if "const" in node:
        node["enum"] = [node.pop("const")]
    for bound, flag in (("exclusiveMinimum", "minimum"), ("exclusiveMaximum", "maximum")):
        if isinstance(node.get(bound), (int, float)) and not isinstance(node.get(bound), bool):
            node[flag] = node.pop(bound)
            node[bound] = True
    extra = node.get("additionalProperties")
    out: dict[str, Any] = {}
    for key, value in node.items():
        if key in _DROP:
            continue
        if key == "properties":
            out[key] = {name: _structural(sub, defs) for name, sub in value.items()}
        elif key == "items":
            out[key] = _structural(value, defs)
        else:
            out[key] = value
    if isinstance(extra, dict):
        out["additionalProperties"] = _structural(extra, defs)
    elif extra is True and "properties" not in out and not out.get("x-kubernetes-preserve-unknown-fields"):
        out["x-kubernetes-preserve-unknown-fields"] = True
    if "default" in out:
        if out["default"] is None or (out["default"] in ([], {}) and "properties" not in out):
            del out["default"]  # empty lists and maps: pydantic fills them; no noise in stored objects
        else:
            out["default"] = _minimal_default(_strip_nulls(out["default"]), out)
    if "type" not in out and not (
        out.get("x-kubernetes-int-or-string") or out.get("x-kubernetes-preserve-unknown-fields")
    ):
        raise ValueError(f"schema node without a type: {out}")
    return out


def openapi_schema(model: type[BaseModel]) -> dict[str, Any]:
    """The structural OpenAPI v3 schema of one pydantic model."""
    raw = model.model_json_schema(by_alias=True, mode="validation", schema_generator=_WithFactoryDefaults)
    return _structural(raw, raw.get("$defs", {}))


def _status_schema(resource: Resource) -> dict[str, Any]:
    schema = openapi_schema(resource.status)
    # Status is written by the operator and the coordinator; keep fields this version does not know
    # (e.g. written by a newer coordinator) rather than pruning them, and apply no defaults to it.
    schema["x-kubernetes-preserve-unknown-fields"] = True
    _drop_defaults(schema)
    return schema


def _drop_defaults(node: dict[str, Any]) -> None:
    node.pop("default", None)
    for sub in node.get("properties", {}).values():
        _drop_defaults(sub)
    if isinstance(node.get("items"), dict):
        _drop_defaults(node["items"])
    if isinstance(node.get("additionalProperties"), dict):
        _drop_defaults(node["additionalProperties"])


def crd(resource: Resource) -> dict[str, Any]:
    """The CustomResourceDefinition object of one resource."""
    spec = openapi_schema(resource.spec)
    root: dict[str, Any] = {
        "type": "object",
        "description": resource.description,
        "required": ["spec"],
        "properties": {
            "apiVersion": {"type": "string", "description": "anneal.dev/v1alpha1"},
            "kind": {"type": "string", "description": resource.kind},
            "metadata": {"type": "object"},
            "spec": spec,
            "status": _status_schema(resource),
        },
    }
    if resource.rules:
        root["x-kubernetes-validations"] = [dict(r) for r in resource.rules]
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {
            "name": f"{resource.plural}.{GROUP}",
            "labels": {"app.kubernetes.io/part-of": "anneal"},
        },
        "spec": {
            "group": GROUP,
            "scope": "Namespaced",
            "names": {
                "kind": resource.kind,
                "listKind": f"{resource.kind}List",
                "plural": resource.plural,
                "singular": resource.singular,
                "shortNames": list(resource.short_names),
                "categories": ["anneal", "all"],
            },
            "versions": [
                {
                    "name": VERSION,
                    "served": True,
                    "storage": True,
                    "subresources": {"status": {}},
                    "additionalPrinterColumns": list(resource.printer_columns),
                    "schema": {"openAPIV3Schema": root},
                }
            ],
        },
    }


def crds() -> list[dict[str, Any]]:
    return [crd(r) for r in RESOURCES]


_HEADER = "# Generated by `anneal crds` (anneal.operator.crdgen) from anneal.operator.api. Do not edit.\n"


def render(obj: dict[str, Any]) -> str:
    return _HEADER + yaml.safe_dump(obj, sort_keys=False, width=100)


def render_all() -> str:
    return "---\n".join(render(obj) for obj in crds())


def expected_files() -> dict[Path, str]:
    """Every generated file and its content."""
    files = {}
    for directory in OUTPUT_DIRS:
        for resource, obj in zip(RESOURCES, crds()):
            files[directory / f"{GROUP}_{resource.plural}.yaml"] = render(obj)
    return files


def stale_files() -> list[Path]:
    return [p for p, text in expected_files().items() if not p.exists() or p.read_text() != text]


def write() -> list[Path]:
    written = []
    for path, text in expected_files().items():
        path.parent.mkdir(parents=True, exist_ok=True)
        if not path.exists() or path.read_text() != text:
            path.write_text(text)
            written.append(path)
    return written


def print_crds() -> None:
    """`anneal crds`: the CRD YAML on stdout, ready for `kubectl apply -f -`."""
    sys.stdout.write(render_all())


def _rel(path: Path) -> str:
    return str(path.relative_to(REPO)) if path.is_relative_to(REPO) else str(path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="anneal crds", description=__doc__.split("\n\n")[0])
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--write", action="store_true", help="refresh crds/ and charts/anneal/crds/")
    group.add_argument("--check", action="store_true", help="exit 1 when the generated files are stale")
    args = parser.parse_args(argv)
    if args.write:
        for path in write():
            print(f"wrote {_rel(path)}")
        return 0
    if args.check:
        stale = stale_files()
        for path in stale:
            print(f"stale: {_rel(path)} (run `python -m anneal.operator.crdgen --write`)")
        return 1 if stale else 0
    print_crds()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
