"""Tool-call argument values typed by the tool's JSON Schema, as vLLM 0.32's parser engine does
(`ParserEngine._fix_arg_types`, `tool_parsers.utils.coerce_to_schema_type`).

The XML tool-call form carries every parameter value as text (`<parameter=days>\\n2\\n`); the
value becomes `2` only because the schema says integer. Matching vLLM here decides which JSON the
client sees, and so which arguments it echoes back in the next request.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from typing import Any

# Loose type names models and hand-written schemas use (vLLM's _TYPE_ALIASES).
_ALIASES = {
    "str": "string", "text": "string", "varchar": "string", "char": "string", "enum": "string",
    "int": "integer", "int32": "integer", "int64": "integer", "uint": "integer",
    "uint32": "integer", "uint64": "integer", "long": "integer", "short": "integer",
    "unsigned": "integer", "float": "number", "float32": "number", "float64": "number",
    "double": "number", "bool": "boolean", "dict": "object", "arr": "array", "list": "array",
    "sequence": "array",
}  # fmt: skip
_PRIORITY = ("null", "integer", "number", "boolean", "object", "array", "string")


def schema_types(schema: Any) -> list[str]:
    """Every type a schema allows: `type` (string or list), types of `enum` values, and
    anyOf/oneOf/allOf recursively; ["string"] when nothing says otherwise."""
    if not isinstance(schema, Mapping):
        return ["string"]
    types: set[str] = set()
    declared = schema.get("type")
    if isinstance(declared, str):
        types.add(declared)
    elif isinstance(declared, list):
        types.update(t for t in declared if isinstance(t, str))
    enum = schema.get("enum")
    if isinstance(enum, list):
        for v in enum:
            types.add(_json_type(v))
    for key in ("anyOf", "oneOf", "allOf"):
        choices = schema.get(key)
        if isinstance(choices, list):
            for choice in choices:
                types.update(schema_types(choice))
    return list(types) if types else ["string"]


def _json_type(v: Any) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "boolean"
    if isinstance(v, int):
        return "integer"
    if isinstance(v, float):
        return "number"
    if isinstance(v, list):
        return "array"
    if isinstance(v, dict):
        return "object"
    return "string"


def _finite(obj: Any) -> bool:
    if isinstance(obj, float):
        return math.isfinite(obj)
    if isinstance(obj, list):
        return all(_finite(x) for x in obj)
    if isinstance(obj, dict):
        return all(_finite(x) for x in obj.values())
    return True


def coerce_text(value: str, types: list[str]) -> Any:
    """Best typed reading of `value`, trying null > integer > number > boolean > object >
    array > string among the allowed types; JSON, then the raw text, when none fits."""
    allowed = {_ALIASES.get(t.strip().lower(), t.strip().lower()) for t in types}
    for kind in _PRIORITY:
        if kind not in allowed:
            continue
        if kind == "null":
            if value.lower() == "null":
                return None
        elif kind == "string":
            return value
        elif kind == "integer":
            try:
                return int(value)
            except ValueError:
                pass
        elif kind == "number":
            try:
                number = float(value)
            except ValueError:
                continue
            if math.isfinite(number):
                return int(number) if number == int(number) else number  # "1.0" -> 1
        elif kind == "boolean":
            word = value.lower().strip()
            if word in ("true", "1"):
                return True
            if word in ("false", "0"):
                return False
        else:  # object / array
            try:
                parsed = json.loads(value)
            except ValueError:
                continue
            if _finite(parsed):
                return parsed
    try:
        parsed = json.loads(value)
    except ValueError:
        return value
    return parsed if _finite(parsed) else value


def _coerce_value(value: Any, schema: Mapping[str, Any]) -> tuple[Any, bool]:
    if isinstance(value, str):
        coerced = coerce_text(value, schema_types(schema))
        return coerced, coerced is not value
    if isinstance(value, dict):
        props = schema.get("properties")
        if isinstance(props, dict):
            return value, coerce_properties(value, props)
        return value, False
    if isinstance(value, list):
        items = schema.get("items")
        changed = False
        if isinstance(items, dict):
            for i, item in enumerate(value):
                new, item_changed = _coerce_value(item, items)
                if item_changed:
                    value[i] = new
                    changed = True
        return value, changed
    coerced = coerce_text(json.dumps(value, ensure_ascii=False), schema_types(schema))
    if type(coerced) is not type(value) or coerced != value:
        return coerced, True
    return value, False


def coerce_properties(args: dict[str, Any], properties: Mapping[str, Any]) -> bool:
    """Coerce `args` in place by `properties` schemas; True if anything changed."""
    changed = False
    for key, value in args.items():
        prop = properties.get(key)
        if isinstance(prop, dict):
            new, value_changed = _coerce_value(value, prop)
            if value_changed:
                args[key] = new
                changed = True
    return changed


def fix_argument_types(args_json: str, properties: Mapping[str, Any]) -> str:
    """`args_json` with values typed by the schema; unchanged text when nothing changes (so
    a streamed prefix stays a prefix)."""
    if not properties:
        return args_json
    try:
        args = json.loads(args_json)
    except ValueError:
        return args_json
    if not isinstance(args, dict):
        return args_json
    if coerce_properties(args, properties):
        return json.dumps(args, ensure_ascii=False)
    return args_json


def string_only_keys(properties: Mapping[str, Any]) -> set[str] | None:
    """Keys whose values can only be strings (safe to stream unterminated); None without a
    schema, meaning every value stays a string."""
    if not properties:
        return None
    return {k for k, s in properties.items() if set(schema_types(s)) == {"string"}}
