"""Build the CustomResourceDefinition from the pydantic models in api.py.

pydantic emits JSON Schema (draft 2020-12); the API server wants a *structural* OpenAPI v3
schema: no $ref, no titles, no anyOf (except int-or-string), boolean exclusiveMinimum, free-form
objects marked with x-kubernetes-preserve-unknown-fields, and defaults on nested objects so
that a minimal resource gets every default filled in by the API server.
"""

from __future__ import annotations

import copy
from typing import Any

from pydantic import BaseModel

from tandem.operator import api

JsonSchema = dict[str, Any]

PRINTER_COLUMNS = [
    {"name": "Model", "type": "string", "jsonPath": ".spec.model.name"},
    {"name": "Prefill", "type": "string", "jsonPath": ".status.prefill.summary",
     "description": "Ready/desired prefill workers"},
    {"name": "Decode", "type": "string", "jsonPath": ".status.decode.summary",
     "description": "Ready/desired decode workers"},
    {"name": "Ready", "type": "string", "jsonPath": '.status.conditions[?(@.type=="Ready")].status'},
    {"name": "Endpoint", "type": "string", "jsonPath": ".status.endpoint",
     "description": "The OpenAI-compatible base URL (the router's Service)"},
    {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
]


def _resolve(node: JsonSchema, defs: dict[str, JsonSchema]) -> JsonSchema:
    """Inline a $ref, letting the referring node's own keys (its description) win."""
    if "$ref" not in node:
        return node
    target = copy.deepcopy(defs[node["$ref"].rsplit("/", 1)[-1]])
    target.update({key: value for key, value in node.items() if key != "$ref"})
    return target


def _structural(node: JsonSchema, defs: dict[str, JsonSchema]) -> JsonSchema:
    node = _resolve(node, defs)
    out: JsonSchema = {}
    any_of = node.get("anyOf")
    if any_of is not None:
        variants = [_resolve(v, defs) for v in any_of if v.get("type") != "null"]
        types = sorted(v.get("type", "") for v in variants)
        if types == ["integer", "string"]:
            out["x-kubernetes-int-or-string"] = True
        elif len(variants) == 1:
            out.update(_structural(variants[0], defs))
        else:
            raise ValueError(f"cannot express anyOf {any_of} in a structural schema")

    for key, value in node.items():
        if key in ("$ref", "$defs", "anyOf", "title", "additionalProperties", "properties", "items", "required"):
            continue
        if key == "default" and value is None:
            continue
        if key == "exclusiveMinimum":
            out["minimum"], out["exclusiveMinimum"] = value, True
        elif key == "exclusiveMaximum":
            out["maximum"], out["exclusiveMaximum"] = value, True
        elif key == "description":
            out[key] = " ".join(str(value).split())
        else:
            out[key] = value

    if "properties" in node:
        required = set(node.get("required", []))
        props: JsonSchema = {}
        for name, prop in node["properties"].items():
            child = _structural(prop, defs)
            # A nested object without required fields defaults to the defaults of its fields, so the
            # API server fills them in when the user leaves the whole block out. (A bare {} would not
            # do: the API server checks a default against the CEL rules before defaulting inside it.)
            if child.get("type") == "object" and "properties" in child and not child.get("required") \
                    and name not in required and "default" not in child:
                nested = {key: sub["default"] for key, sub in child["properties"].items() if "default" in sub}
                if nested:
                    child["default"] = nested
            props[name] = child
        out["type"] = "object"
        out["properties"] = props
        if required:
            out["required"] = sorted(required)
    additional = node.get("additionalProperties")
    if isinstance(additional, dict) and additional:
        out["additionalProperties"] = _structural(additional, defs)
    elif additional is True or additional == {}:
        # Free-form, or declared fields plus anything else (a passed-through core/v1 Volume: its name is checked).
        out["x-kubernetes-preserve-unknown-fields"] = True
    if "items" in node:
        out["items"] = _structural(node["items"], defs)
    if out.get("type") == "object" and "properties" not in out and "additionalProperties" not in out:
        out["x-kubernetes-preserve-unknown-fields"] = True
    return out


def structural_schema(model: type[BaseModel]) -> JsonSchema:
    raw = model.model_json_schema(by_alias=True, mode="validation")
    return _structural(raw, raw.get("$defs", {}))


def openapi_schema() -> JsonSchema:
    """The root schema of the resource, as it goes into the CRD."""
    spec = structural_schema(api.DisaggregatedModelSpec)
    status = structural_schema(api.DisaggregatedModelStatus)
    return {
        "type": "object",
        "description": " ".join((api.DisaggregatedModelSpec.__doc__ or "").split()),
        "required": ["spec"],
        "properties": {
            "apiVersion": {"type": "string"},
            "kind": {"type": "string"},
            "metadata": {"type": "object"},
            "spec": spec,
            "status": status,
        },
        "x-kubernetes-validations": list(api.ROOT_RULES),
    }


def custom_resource_definition() -> JsonSchema:
    """The DisaggregatedModel CRD."""
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": f"{api.PLURAL}.{api.GROUP}"},
        "spec": {
            "group": api.GROUP,
            "scope": "Namespaced",
            "names": {
                "kind": api.KIND,
                "listKind": f"{api.KIND}List",
                "plural": api.PLURAL,
                "singular": api.SINGULAR,
                "shortNames": list(api.SHORT_NAMES),
                "categories": ["tandem"],
            },
            "versions": [
                {
                    "name": api.VERSION,
                    "served": True,
                    "storage": True,
                    "subresources": {"status": {}},
                    "additionalPrinterColumns": PRINTER_COLUMNS,
                    "schema": {"openAPIV3Schema": openapi_schema()},
                }
            ],
        },
    }


POOL_PRINTER_COLUMNS = [
    {"name": "Model", "type": "string", "jsonPath": ".spec.model"},
    {"name": "Pool", "type": "string", "jsonPath": ".spec.pool"},
    {"name": "Scaled-By", "type": "string", "jsonPath": ".status.scaledBy",
     "description": "Who owns the replica count: spec, autoscaler or external"},
    {"name": "Spec", "type": "integer", "jsonPath": ".spec.replicas",
     "description": "Replicas asked for here (used when scaled by external)"},
    {"name": "Desired", "type": "integer", "jsonPath": ".status.desiredReplicas"},
    {"name": "Ready", "type": "integer", "jsonPath": ".status.readyReplicas"},
    {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
]


def pool_openapi_schema() -> JsonSchema:
    """The root schema of a DisaggregatedPool."""
    return {
        "type": "object",
        "description": " ".join((api.DisaggregatedPoolSpec.__doc__ or "").split()),
        "required": ["spec"],
        "properties": {
            "apiVersion": {"type": "string"},
            "kind": {"type": "string"},
            "metadata": {"type": "object"},
            "spec": structural_schema(api.DisaggregatedPoolSpec),
            "status": structural_schema(api.DisaggregatedPoolStatus),
        },
    }


def pool_custom_resource_definition() -> JsonSchema:
    """The DisaggregatedPool CRD: a scale subresource per pool, so kubectl scale, HPA and KEDA can drive it."""
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": f"{api.POOL_PLURAL}.{api.GROUP}"},
        "spec": {
            "group": api.GROUP,
            "scope": "Namespaced",
            "names": {
                "kind": api.POOL_KIND,
                "listKind": f"{api.POOL_KIND}List",
                "plural": api.POOL_PLURAL,
                "singular": api.POOL_SINGULAR,
                "shortNames": list(api.POOL_SHORT_NAMES),
                "categories": ["tandem"],
            },
            "versions": [
                {
                    "name": api.VERSION,
                    "served": True,
                    "storage": True,
                    "subresources": {
                        "status": {},
                        "scale": {
                            "specReplicasPath": ".spec.replicas",
                            "statusReplicasPath": ".status.replicas",
                            "labelSelectorPath": ".status.selector",
                        },
                    },
                    "additionalPrinterColumns": POOL_PRINTER_COLUMNS,
                    "schema": {"openAPIV3Schema": pool_openapi_schema()},
                }
            ],
        },
    }
