"""Hypothesis strategies from an OpenAPI document's JSON Schemas (the subset FastAPI and
pydantic emit: $ref, type, properties/required, additionalProperties, anyOf/oneOf/allOf,
enum/const, items/minItems/maxItems, minimum/maximum/exclusive bounds, minLength/maxLength).

Written here because hypothesis-jsonschema 0.23 no longer runs on current hypothesis.
Optional properties are present or absent at random; values respect the schema, so every
generated body is one the server must accept or reject with a 4xx by its own rules (values
such as NaN, huge numbers, odd Unicode and extra nesting are included where the schema
allows them).
"""

from __future__ import annotations

import math
from typing import Any

from hypothesis import strategies as st

_JSON_SCALARS = st.one_of(st.none(), st.booleans(), st.integers(-10, 10**6),
                          st.floats(allow_nan=False, allow_infinity=False),  # JSON has neither
                          st.text(max_size=8))
_ANY_JSON = st.recursive(_JSON_SCALARS, lambda c: st.one_of(st.lists(c, max_size=3),
                                                             st.dictionaries(st.text(max_size=5), c, max_size=3)),
                         max_leaves=6)


def from_schema(schema: dict[str, Any], root: dict[str, Any], depth: int = 0) -> st.SearchStrategy:
    if depth > 12:
        return st.none()
    if "$ref" in schema:
        node: Any = root
        for part in schema["$ref"].lstrip("#/").split("/"):
            node = node[part]
        return from_schema(node, root, depth + 1)
    if "const" in schema:
        return st.just(schema["const"])
    if "enum" in schema:
        return st.sampled_from(schema["enum"])
    for key in ("anyOf", "oneOf"):
        if key in schema:
            return st.one_of([from_schema(s, root, depth + 1) for s in schema[key]])
    if "allOf" in schema:
        merged: dict[str, Any] = {}
        for s in schema["allOf"]:
            merged.update(s)
        return from_schema(merged, root, depth + 1)
    t = schema.get("type")
    if isinstance(t, list):
        return st.one_of([from_schema({**schema, "type": x}, root, depth + 1) for x in t])
    if t == "null":
        return st.none()
    if t == "boolean":
        return st.booleans()
    if t == "integer":
        lo, hi = schema.get("minimum"), schema.get("maximum")
        if "exclusiveMinimum" in schema:
            lo = schema["exclusiveMinimum"] + 1
        if "exclusiveMaximum" in schema:
            hi = schema["exclusiveMaximum"] - 1
        return st.integers(None if lo is None else int(lo), None if hi is None else int(hi))
    if t == "number":
        lo = schema.get("exclusiveMinimum", schema.get("minimum"))
        hi = schema.get("exclusiveMaximum", schema.get("maximum"))
        ints = st.integers(-(10**9) if lo is None else math.ceil(lo), 10**9 if hi is None else math.floor(hi))
        ints = ints.filter(lambda x: (lo is None or x > lo or "exclusiveMinimum" not in schema)
                           and (hi is None or x < hi or "exclusiveMaximum" not in schema))
        return st.floats(lo, hi, exclude_min=lo is not None and "exclusiveMinimum" in schema,
                         exclude_max=hi is not None and "exclusiveMaximum" in schema,
                         allow_nan=False, allow_infinity=False) | ints
    if t == "string":
        lo = schema.get("minLength", 0)
        return st.text(min_size=lo, max_size=max(lo, min(schema.get("maxLength", 40), 40)))
    if t == "array":
        items = from_schema(schema.get("items", {}), root, depth + 1)
        return st.lists(items, min_size=schema.get("minItems", 0),
                        max_size=min(schema.get("maxItems", 4), 4))
    if t == "object" or "properties" in schema:
        props = schema.get("properties", {})
        required = set(schema.get("required", []))
        fixed = {k: from_schema(v, root, depth + 1) for k, v in props.items() if k in required}
        optional = {k: from_schema(v, root, depth + 1) for k, v in props.items() if k not in required}
        extra = schema.get("additionalProperties", False)
        extra_st = (_ANY_JSON if extra is True else from_schema(extra, root, depth + 1)) if extra else None
        base = st.fixed_dictionaries(fixed, optional=optional)
        if extra_st is None:
            return base
        return st.tuples(base, st.dictionaries(st.text(max_size=6), extra_st, max_size=3)).map(
            lambda kv: {**kv[1], **kv[0]})
    return _ANY_JSON  # no constraint: any JSON value
