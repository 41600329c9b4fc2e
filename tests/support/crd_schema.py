"""What the Kubernetes API server does with a CustomResourceDefinition's schema, for the API double.

Two parts, written from the API server's rules (apiextensions-apiserver: ``validation.go``'s
``ValidateCustomResourceDefinitionOpenAPISchema``, ``schema/validation.go``'s structural checks, and
``pruning/algorithm.go``), not from cachefs code:

**Structural schema** (``structural_problems``): an ``apiextensions.k8s.io/v1`` CRD is refused unless
each version's ``openAPIV3Schema`` is structural. The rules checked here, each with the API server's
own wording where it has one:

- every node of ``properties``, ``items`` and ``additionalProperties`` has a non-empty ``type``,
  except where ``x-kubernetes-int-or-string: true`` (then ``type`` must be empty) or
  ``x-kubernetes-preserve-unknown-fields: true`` allow otherwise ("type: Required value: must not be
  empty for specified object fields");
- ``properties`` and ``additionalProperties`` (a schema, or ``false``) never in one node
  ("additionalProperties and properties are mutual exclusive");
- ``properties`` only on ``type: object``, ``items`` only on ``type: array``, and an array has ``items``;
- ``x-kubernetes-preserve-unknown-fields`` is ``true`` or absent ("must be true or undefined");
- ``uniqueItems: true`` is refused (quadratic to check);
- inside ``allOf``/``anyOf``/``oneOf``/``not`` no ``type``, ``default``, ``description``, ``nullable``,
  ``additionalProperties`` or ``x-kubernetes-*`` (value validations only);
- at the root, ``type: object``; ``metadata`` restricts nothing but ``name`` and ``generateName``
  (and those only with ``type: string`` value checks).

**Pruning** (``prune``): on every create, update, patch and status write of a custom resource the
API server drops each field that the schema does not declare (unless ``x-kubernetes-preserve-unknown-
fields: true`` covers it), before storing. ``apiVersion``, ``kind`` and ``metadata`` at the root are
never pruned here (the server keeps ObjectMeta's own fields). An object node with neither
``properties`` nor ``additionalProperties`` nor preserve-unknown-fields keeps no field at all.
``prune`` returns the pruned object and the paths it dropped (a real server drops them silently;
the double records them so a test can say which write lost what).

**Defaulting** (``apply_defaults``, after pruning, as ``structural/defaulting/algorithm.go``): a
property the object lacks gets its schema's ``default`` (a copy), and so does one that is ``null``
without ``nullable: true``; the defaults of its children are applied inside it, the new value
included. An absent parent is not created for its children's defaults: ``spec.a.b``'s default
appears only where ``spec.a`` exists (or has a default of its own). Lists and maps apply ``items`` /
``additionalProperties`` to each element. ``metadata`` is never defaulted here.

**Validation** (``invalid_fields``, after defaulting, on create, update, patch and status writes):
the value checks of the schema (``type``, ``enum``, ``pattern``, ``minimum``/``maximum``,
``minLength``/``maxLength``, ``minItems``/``maxItems``, ``maxProperties``, ``required``, ...) as the
API server's OpenAPI validator runs them, by ``jsonschema`` (the ``x-kubernetes-*`` extensions and
``nullable`` are not JSON Schema: the validator skips the first, and the CRDs here use neither on
a value that could be null). A failure is a 422 ``Invalid`` naming each field, as the API server
answers (``spec.cache.maxFetches: Invalid value: 0: ...``); ``metadata`` is left out, as there.
"""

from __future__ import annotations

import copy
from typing import Any, Iterator, Mapping

PRESERVE = "x-kubernetes-preserve-unknown-fields"
INT_OR_STRING = "x-kubernetes-int-or-string"
JUNCTORS = ("allOf", "anyOf", "oneOf", "not")
# What a value validation inside a junctor may not carry (structural schema rule 3).
_NOT_IN_JUNCTORS = ("type", "default", "description", "nullable", "additionalProperties")
_METADATA_FIELDS_ALLOWED = {"name", "generateName"}
_ROOT_FIELDS = ("apiVersion", "kind", "metadata")


def structural_problems(crd: Mapping[str, Any]) -> list[str]:
    """Why the API server would refuse ``crd`` (an ``apiextensions.k8s.io/v1`` CRD); [] when it would not."""
    problems: list[str] = []
    name = (crd.get("metadata") or {}).get("name", "?")
    for index, version in enumerate((crd.get("spec") or {}).get("versions") or []):
        schema = ((version.get("schema") or {}).get("openAPIV3Schema"))
        where = f"spec.versions[{index}].schema.openAPIV3Schema"
        if not isinstance(schema, dict):
            problems.append(f"{where}: Required value: schemas are required")
            continue
        if schema.get("type") != "object":
            problems.append(f"{where}.type: Invalid value: {schema.get('type')!r}: must be object at the root")
        problems += _check(schema, where)
        meta = (schema.get("properties") or {}).get("metadata")
        if isinstance(meta, dict):
            problems += _check_metadata(meta, f"{where}.properties[metadata]")
    return [f"CustomResourceDefinition {name}: {p}" for p in problems]


def _children(node: Mapping[str, Any], where: str) -> Iterator[tuple[Mapping[str, Any], str]]:
    for key, child in (node.get("properties") or {}).items():
        yield child, f"{where}.properties[{key}]"
    if isinstance(node.get("items"), dict):
        yield node["items"], f"{where}.items"
    if isinstance(node.get("additionalProperties"), dict):
        yield node["additionalProperties"], f"{where}.additionalProperties"


def _check(node: Mapping[str, Any], where: str) -> list[str]:
    problems: list[str] = []
    kind = node.get("type")
    preserve, int_or_string = node.get(PRESERVE), node.get(INT_OR_STRING)
    if PRESERVE in node and preserve is not True:
        problems.append(f"{where}.{PRESERVE}: Invalid value: {preserve!r}: must be true or undefined")
    if int_or_string is True:
        if kind:
            problems.append(f"{where}.type: Invalid value: {kind!r}: must be empty if {INT_OR_STRING} is true")
    elif not kind and preserve is not True:
        problems.append(f"{where}.type: Required value: must not be empty for specified object fields")
    if "properties" in node and "additionalProperties" in node and node["additionalProperties"] is not True:
        problems.append(f"{where}.additionalProperties: Forbidden: additionalProperties and properties are "
                        "mutual exclusive")
    if "properties" in node and kind not in (None, "object"):
        problems.append(f"{where}.properties: Forbidden: only allowed for type object, not {kind!r}")
    if "items" in node and kind != "array":
        problems.append(f"{where}.items: Forbidden: only allowed for type array, not {kind!r}")
    if kind == "array" and not isinstance(node.get("items"), dict):
        problems.append(f"{where}.items: Required value: must be specified (one schema) for type array")
    if node.get("uniqueItems") is True:
        problems.append(f"{where}.uniqueItems: Forbidden: uniqueItems cannot be set to true since the runtime "
                        "complexity becomes quadratic")
    for junctor in JUNCTORS:
        for index, sub in enumerate(_as_list(node.get(junctor))):
            problems += _check_value_validation(sub, f"{where}.{junctor}[{index}]")
    for child, child_where in _children(node, where):
        problems += _check(child, child_where)
    return problems


def _as_list(value: Any) -> list[Mapping[str, Any]]:
    if isinstance(value, dict):
        return [value]
    return [v for v in value if isinstance(v, dict)] if isinstance(value, list) else []


def _check_value_validation(node: Mapping[str, Any], where: str) -> list[str]:
    problems = [f"{where}.{key}: Forbidden: must not be specified in a nested {where.rsplit('.', 1)[-1]}"
                for key in node if key in _NOT_IN_JUNCTORS or key.startswith("x-kubernetes-")]
    for junctor in JUNCTORS:
        for index, sub in enumerate(_as_list(node.get(junctor))):
            problems += _check_value_validation(sub, f"{where}.{junctor}[{index}]")
    for child, child_where in _children(node, where):
        problems += _check_value_validation(child, child_where)
    return problems


def _check_metadata(meta: Mapping[str, Any], where: str) -> list[str]:
    problems = []
    if meta.get("type") != "object":
        problems.append(f"{where}.type: Invalid value: {meta.get('type')!r}: must be object")
    for key in meta:
        if key not in ("type", "properties", "description"):
            problems.append(f"{where}.{key}: Forbidden: must not be specified at metadata")
    for key, child in (meta.get("properties") or {}).items():
        if key not in _METADATA_FIELDS_ALLOWED:
            problems.append(f"{where}.properties[{key}]: Forbidden: only name and generateName may be restricted")
        elif isinstance(child, dict) and child.get("type") != "string":
            problems.append(f"{where}.properties[{key}].type: Invalid value: {child.get('type')!r}: must be string")
    return problems


# ------------------------------------------------------------------------------------------ pruning
def prune(obj: Mapping[str, Any], schema: Mapping[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """``obj`` without the fields ``schema`` (a version's openAPIV3Schema) does not declare; the dropped paths."""
    pruned = copy.deepcopy(dict(obj))
    dropped: list[str] = []
    properties = schema.get("properties") or {}
    for key in list(pruned):
        if key in _ROOT_FIELDS:
            continue
        if key in properties:
            pruned[key] = _prune_value(pruned[key], properties[key], key, dropped)
        elif schema.get(PRESERVE) is not True:
            del pruned[key]
            dropped.append(key)
    return pruned, dropped


def _prune_value(value: Any, node: Mapping[str, Any], path: str, dropped: list[str]) -> Any:
    if isinstance(value, dict):
        properties = node.get("properties") or {}
        extra = node.get("additionalProperties")
        for key in list(value):
            if key in properties:
                value[key] = _prune_value(value[key], properties[key], f"{path}.{key}", dropped)
            elif isinstance(extra, dict):
                value[key] = _prune_value(value[key], extra, f"{path}.{key}", dropped)
            elif node.get(PRESERVE) is not True and extra is not True:
                del value[key]
                dropped.append(f"{path}.{key}")
    elif isinstance(value, list) and isinstance(node.get("items"), dict):
        return [_prune_value(item, node["items"], f"{path}[{index}]", dropped) for index, item in enumerate(value)]
    return value


def apply_defaults(obj: Mapping[str, Any], schema: Mapping[str, Any]) -> dict[str, Any]:
    """``obj`` with the schema's defaults applied (module docstring: "Defaulting"); ``metadata`` untouched."""
    out = copy.deepcopy(dict(obj))
    meta = out.pop("metadata", None)
    _default_object(out, schema)
    if meta is not None:
        out["metadata"] = meta
    return out


def _default_object(value: dict[str, Any], node: Mapping[str, Any]) -> None:
    properties = node.get("properties") or {}
    for key, child in properties.items():
        if "default" in child and (key not in value or (value[key] is None and not child.get("nullable"))):
            value[key] = copy.deepcopy(child["default"])
        if key in value:
            _default_value(value[key], child)
    extra = node.get("additionalProperties")
    if isinstance(extra, dict):
        for key in value:
            if key not in properties:
                _default_value(value[key], extra)


def _default_value(value: Any, node: Mapping[str, Any]) -> None:
    if isinstance(value, dict):
        _default_object(value, node)
    elif isinstance(value, list) and isinstance(node.get("items"), dict):
        for item in value:
            _default_value(item, node["items"])


def invalid_fields(obj: Mapping[str, Any], schema: Mapping[str, Any]) -> list[str]:
    """Why the API server would refuse ``obj`` under ``schema`` (one line per field); [] when it would not."""
    import jsonschema

    body = {k: v for k, v in obj.items() if k != "metadata"}
    checked = {k: v for k, v in schema.items() if k != "properties"}
    checked["properties"] = {k: v for k, v in (schema.get("properties") or {}).items() if k != "metadata"}
    problems = []
    for error in sorted(jsonschema.Draft7Validator(checked).iter_errors(body), key=lambda e: list(e.absolute_path)):
        path = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in error.absolute_path).lstrip(".") or "<root>"
        if error.validator == "required":
            problems.append(f"{path}: Required value: {error.message}")
        elif error.validator == "enum":
            supported = ", ".join(f'"{v}"' for v in error.validator_value)
            problems.append(f"{path}: Unsupported value: {error.instance!r}: supported values: {supported}")
        else:
            problems.append(f"{path}: Invalid value: {error.instance!r}: {error.message}")
    return problems


def merge_patch_between(old: Mapping[str, Any], new: Mapping[str, Any]) -> dict[str, Any]:
    """The JSON merge patch (RFC 7386) that turns ``old`` into ``new`` (``None`` removes a key)."""
    patch: dict[str, Any] = {}
    for key in old:
        if key not in new:
            patch[key] = None
    for key, value in new.items():
        if key in old and isinstance(old[key], dict) and isinstance(value, dict):
            inner = merge_patch_between(old[key], value)
            if inner:
                patch[key] = inner
        elif key not in old or old[key] != value:
            patch[key] = value
    return patch
