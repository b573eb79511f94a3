"""A small JSON-schema validator for agent outputs (the subset small models are asked to produce).

Supported keywords: ``type`` (one or a list), ``properties``, ``required``, ``additionalProperties``
(bool or schema), ``items``, ``minItems``/``maxItems``, ``minLength``/``maxLength``,
``minimum``/``maximum``, ``enum``, ``const``, ``anyOf``/``oneOf``/``allOf`` and local ``$ref``
(``#/$defs/...`` or ``#/definitions/...``). Unknown keywords are ignored, as JSON schema does.
"""

from __future__ import annotations

from typing import Any

__all__ = ["SUPPORTED_TYPES", "schema_errors", "check_schema"]

SUPPORTED_TYPES = ("object", "array", "string", "number", "integer", "boolean", "null")


def _is_type(value: object, name: str) -> bool:
    if name == "object":
        return isinstance(value, dict)
    if name == "array":
        return isinstance(value, list)
    if name == "string":
        return isinstance(value, str)
    if name == "boolean":
        return isinstance(value, bool)
    if name == "null":
        return value is None
    if name == "integer":
        return isinstance(value, int) and not isinstance(value, bool)
    if name == "number":
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    return True


def _resolve(ref: str, root: dict[str, Any]) -> dict[str, Any]:
    if not ref.startswith("#/"):
        raise ValueError(f"only local $ref are supported, got {ref!r}")
    node: Any = root
    for part in ref[2:].split("/"):
        if not isinstance(node, dict) or part not in node:
            raise ValueError(f"$ref {ref!r} does not resolve inside the schema")
        node = node[part]
    return node


def check_schema(schema: dict[str, Any]) -> None:
    """Raise ValueError if ``schema`` uses a form this validator cannot check (bad type, remote $ref)."""

    def walk(node: object) -> None:
        if isinstance(node, dict):
            types = node.get("type")
            for t in [types] if isinstance(types, str) else (types or []):
                if t not in SUPPORTED_TYPES:
                    raise ValueError(f"unknown JSON schema type {t!r}; use one of {SUPPORTED_TYPES}")
            if "$ref" in node:
                _resolve(node["$ref"], schema)
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    if not isinstance(schema, dict):
        raise ValueError("a JSON schema must be a JSON object (a dict)")
    walk(schema)


def schema_errors(value: Any, schema: dict[str, Any], *, root: dict[str, Any] | None = None,
                  path: str = "$") -> list[str]:
    """Every way ``value`` violates ``schema``, as ``path: problem`` strings (empty when valid)."""
    root = schema if root is None else root
    if "$ref" in schema:
        return schema_errors(value, _resolve(schema["$ref"], root), root=root, path=path)
    errors: list[str] = []
    types = schema.get("type")
    if types is not None:
        names = [types] if isinstance(types, str) else list(types)
        if not any(_is_type(value, n) for n in names):
            return [f"{path}: expected {' or '.join(names)}, got {type(value).__name__}"]
    if "const" in schema and value != schema["const"]:
        errors.append(f"{path}: must equal {schema['const']!r}")
    if "enum" in schema and value not in schema["enum"]:
        errors.append(f"{path}: must be one of {schema['enum']!r}")
    if isinstance(value, dict):
        props = schema.get("properties", {})
        for key in schema.get("required", []):
            if key not in value:
                errors.append(f"{path}: missing required field {key!r}")
        extra = schema.get("additionalProperties", True)
        for key, item in value.items():
            if key in props:
                errors += schema_errors(item, props[key], root=root, path=f"{path}.{key}")
            elif extra is False:
                errors.append(f"{path}: unexpected field {key!r}")
            elif isinstance(extra, dict):
                errors += schema_errors(item, extra, root=root, path=f"{path}.{key}")
    if isinstance(value, list):
        if "minItems" in schema and len(value) < schema["minItems"]:
            errors.append(f"{path}: needs at least {schema['minItems']} items")
        if "maxItems" in schema and len(value) > schema["maxItems"]:
            errors.append(f"{path}: allows at most {schema['maxItems']} items")
        if isinstance(schema.get("items"), dict):
            for i, item in enumerate(value):
                errors += schema_errors(item, schema["items"], root=root, path=f"{path}[{i}]")
    if isinstance(value, str):
        if "minLength" in schema and len(value) < schema["minLength"]:
            errors.append(f"{path}: shorter than {schema['minLength']} characters")
        if "maxLength" in schema and len(value) > schema["maxLength"]:
            errors.append(f"{path}: longer than {schema['maxLength']} characters")
    if _is_type(value, "number"):
        if "minimum" in schema and value < schema["minimum"]:
            errors.append(f"{path}: below the minimum {schema['minimum']}")
        if "maximum" in schema and value > schema["maximum"]:
            errors.append(f"{path}: above the maximum {schema['maximum']}")
    for sub in schema.get("allOf", []):
        errors += schema_errors(value, sub, root=root, path=path)
    for key in ("anyOf", "oneOf"):
        options = schema.get(key)
        if options and all(schema_errors(value, sub, root=root, path=path) for sub in options):
            errors.append(f"{path}: matches none of the allowed forms ({key})")
    return errors
