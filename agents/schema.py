"""JSON-schema checks of agent outputs and of the schemas users give, by the `jsonschema` library.

Every keyword of the schema's draft is checked (2020-12 unless the schema's ``$schema`` names another):
``oneOf`` means exactly one, ``pattern``, ``uniqueItems``, ``multipleOf``, ``not``, ``prefixItems``,
``format`` (the formats `jsonschema.FormatChecker` knows, such as ``date``, ``email``, ``ipv4``, ``uuid``) and
the rest. A ``$ref`` must point inside the schema (``#/$defs/...``): a schema never makes this process read a
file or fetch a URL. The grammar a JSON agent decodes under is xgrammar's (`agents.constrained`); this module
says whether what came out, or what a user wrote, is right.
"""

from __future__ import annotations

from collections.abc import Iterator
from functools import lru_cache
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from jsonschema.protocols import Validator

__all__ = ["schema_errors", "check_schema"]


def _refs(node: object) -> Iterator[str]:
    if isinstance(node, dict):
        for key, value in node.items():
            if key in ("$ref", "$dynamicRef") and isinstance(value, str):
                yield value
            else:
                yield from _refs(value)
    elif isinstance(node, list):
        for value in node:
            yield from _refs(value)


def check_schema(schema: dict[str, Any]) -> None:
    """Raise ValueError, saying where, if `schema` is not a valid JSON schema or has a ``$ref`` outside itself."""
    from jsonschema.exceptions import SchemaError
    from jsonschema.validators import validator_for

    if not isinstance(schema, dict):
        raise ValueError("a JSON schema must be a JSON object (a dict)")
    for ref in _refs(schema):
        if not ref.startswith("#"):
            raise ValueError(f"only $ref inside the schema are supported (#/$defs/...), got {ref!r}")
    try:
        validator_for(schema).check_schema(schema)
    except SchemaError as exc:
        where = "/".join(str(p) for p in exc.path)
        raise ValueError(f"invalid JSON schema{f' at {where}' if where else ''}: {exc.message}") from None


def _validator(schema: dict[str, Any]) -> Validator:
    import json

    return _cached_validator(json.dumps(schema, sort_keys=True))


@lru_cache(maxsize=256)
def _cached_validator(text: str) -> Validator:
    """One compiled validator per schema: an agent checks every reply (and every retry) against the same one."""
    import json

    from jsonschema import FormatChecker
    from jsonschema.validators import validator_for
    from referencing import Registry

    schema = json.loads(text)
    cls = validator_for(schema)

    def refuse(uri: str) -> Any:  # a $ref outside the schema is never fetched
        from referencing.exceptions import NoSuchResource

        raise NoSuchResource(ref=uri)  # type: ignore[call-arg]

    return cls(schema, format_checker=FormatChecker(), registry=Registry(retrieve=refuse))  # type: ignore[call-arg]


def _path(parts: Any) -> str:
    out = "$"
    for part in parts:
        out += f"[{part}]" if isinstance(part, int) else f".{part}"
    return out


def schema_errors(value: Any, schema: dict[str, Any]) -> list[str]:
    """Every way `value` violates `schema`, as ``$.path: problem`` strings in document order (empty when valid)."""
    errors = sorted(_validator(schema).iter_errors(value), key=lambda e: [str(p) for p in e.absolute_path])
    return [f"{_path(e.absolute_path)}: {e.message}" for e in errors]
