"""JSON schemas of varied shape for the structured-output tests (test data, not fixtures).

Strings carry a maxLength and arrays a maxItems where the shape allows: the constraint forces
validity, but a tiny model may otherwise never close a string within max_tokens.
"""

S = {"type": "string", "maxLength": 8}

SCHEMAS: list[dict] = [
    {"type": "object", "properties": {"name": S}, "required": ["name"]},
    {"type": "object", "properties": {"big": {"type": "integer", "minimum": -1000000, "maximum": 1000000}}, "required": ["big"]},
    {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]},
    {"type": "object", "properties": {"x": {"type": "null"}}, "required": ["x"]},
    {"type": "object", "properties": {"age": {"type": "integer", "minimum": 18, "maximum": 99}}, "required": ["age"]},
    {"type": "object", "properties": {"t": {"type": "number", "minimum": -5, "maximum": 5}}, "required": ["t"]},
    {"type": "object", "properties": {"n": {"type": "integer", "exclusiveMinimum": 0, "exclusiveMaximum": 10}}, "required": ["n"]},
    {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}}, "required": ["color"]},
    {"type": "object", "properties": {"k": {"const": "fixed"}}, "required": ["k"]},
    {"type": "object", "properties": {"mixed": {"enum": [1, "two", None, True]}}, "required": ["mixed"]},
    {"type": "object", "properties": {"code": {"type": "string", "pattern": "^[A-Z]{3}[0-9]{2}$"}}, "required": ["code"]},
    {"type": "object", "properties": {"d": {"type": "string", "format": "date"}}, "required": ["d"]},
    {"type": "object", "properties": {"id": {"type": "string", "format": "uuid"}}, "required": ["id"]},
    {"type": "object", "properties": {"ip": {"type": "string", "format": "ipv4"}}, "required": ["ip"]},
    {"type": "object", "properties": {"s": {"type": "string", "minLength": 3, "maxLength": 5}}, "required": ["s"]},
    {"type": "object", "properties": {"tags": {"type": "array", "items": S, "minItems": 2, "maxItems": 3}}, "required": ["tags"]},
    {"type": "object", "properties": {"v": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "minItems": 1, "maxItems": 4}}, "required": ["v"]},
    {"type": "object", "properties": {"empty": {"type": "array", "maxItems": 0}}, "required": ["empty"]},
    {"type": "array", "items": {"type": "boolean"}, "minItems": 3, "maxItems": 3},
    {"type": "array", "prefixItems": [{"type": "integer", "minimum": 0, "maximum": 5}, {"enum": ["a", "b"]}], "items": False},
    {"type": "object", "properties": {"p": {"type": "object", "properties": {"x": {"type": "integer", "minimum": 0, "maximum": 100}, "y": {"type": "integer", "minimum": 0, "maximum": 100}}, "required": ["x", "y"]}}, "required": ["p"]},
    {"type": "object", "properties": {"a": {"type": "object", "properties": {"b": {"type": "object", "properties": {"c": {"enum": [1, 2]}}, "required": ["c"]}}, "required": ["b"]}}, "required": ["a"]},
    {"type": "object", "properties": {"people": {"type": "array", "minItems": 1, "maxItems": 2, "items": {"type": "object", "properties": {"name": S, "age": {"type": "integer", "minimum": 0, "maximum": 120}}, "required": ["name", "age"]}}}, "required": ["people"]},
    {"type": "object", "properties": {"v": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 9}, {"type": "boolean"}]}}, "required": ["v"]},
    {"type": "object", "properties": {"v": {"anyOf": [S, {"type": "null"}]}}, "required": ["v"]},
    {"type": "object", "properties": {"v": {"oneOf": [{"const": "on"}, {"const": "off"}]}}, "required": ["v"]},
    {"type": "object", "properties": {"name": S, "nick": S}, "required": ["name"]},
    {"type": "object", "properties": {"a": {"type": "boolean"}, "b": {"type": "boolean"}, "c": {"type": "boolean"}}},
    {"type": "object", "properties": {"first": S, "last": S, "age": {"type": "integer", "minimum": 1, "maximum": 99}}, "required": ["first", "last", "age"], "additionalProperties": False},
    {"$defs": {"pt": {"type": "object", "properties": {"x": {"enum": [0, 1]}}, "required": ["x"]}}, "type": "object", "properties": {"from": {"$ref": "#/$defs/pt"}, "to": {"$ref": "#/$defs/pt"}}, "required": ["from", "to"]},
    {"type": "object", "properties": {"opt": {"type": "array", "items": {"enum": ["x", "y"]}, "maxItems": 2}}, "required": []},
    {"type": "object", "properties": {"grid": {"type": "array", "minItems": 2, "maxItems": 2, "items": {"type": "array", "minItems": 2, "maxItems": 2, "items": {"enum": [0, 1]}}}}, "required": ["grid"]},
    {"type": "object", "properties": {"status": {"enum": ["ok", "err"]}, "detail": {"anyOf": [{"type": "object", "properties": {"code": {"type": "integer", "minimum": 100, "maximum": 599}}, "required": ["code"]}, {"type": "null"}]}}, "required": ["status", "detail"]},
    {"type": "string", "enum": ["alpha", "beta"]},
    {"type": "integer", "minimum": -3, "maximum": 3},
]
