"""JSON schemas as a model should fill them: an object schema that lists its properties and says
nothing of others allows no others (as xgrammar's strict mode and OpenAI's strict schemas do). A
model held to a schema that leaves them open may write property after invented property and never
close the object (seen on small models)."""

_SCHEMA = ("items", "additionalProperties", "not", "if", "then", "else", "contains", "propertyNames",
           "unevaluatedProperties", "unevaluatedItems", "additionalItems")
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SCHEMA_LISTS = ("anyOf", "allOf", "oneOf", "prefixItems", "items")


def closed(schema):
    """A copy of `schema` with additionalProperties false wherever an object lists its properties
    and leaves the rest unsaid."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _SCHEMA:
        if isinstance(out.get(key), dict):
            out[key] = closed(out[key])
    for key in _SCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {name: closed(sub) for name, sub in out[key].items()}
    for key in _SCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [closed(sub) for sub in out[key]]
    if "properties" in out and not {"additionalProperties", "patternProperties", "unevaluatedProperties"} & out.keys():
        out["additionalProperties"] = False
    return out
