"""JSON schemas of varied shape, each with a prompt that asks for it (a helper, not tests):
what the structured-output tests generate against and the benchmark compiles.

Together they cover nested objects, arrays with bounds, enums and const, numbers with
bounds, required and optional properties, additionalProperties, $ref/$defs (recursive
too), anyOf, nullable types and string formats. Strings carry a maxLength where a small
model might otherwise write one forever: the constraint holds either way, but a
document cut off by max_tokens does not parse.
"""

from __future__ import annotations

from typing import Any

NAME = {"type": "string", "maxLength": 24}
SHORT = {"type": "string", "maxLength": 40}

SCHEMAS: list[tuple[str, dict[str, Any]]] = [
    (
        "A person with a name and an age.",
        {
            "type": "object",
            "properties": {"name": NAME, "age": {"type": "integer", "minimum": 0, "maximum": 130}},
            "required": ["name", "age"],
        },
    ),
    (
        "A product with a price in dollars.",
        {
            "type": "object",
            "properties": {
                "title": SHORT,
                "price": {"type": "number", "minimum": 0, "maximum": 10000},
                "in_stock": {"type": "boolean"},
            },
            "required": ["title", "price", "in_stock"],
            "additionalProperties": False,
        },
    ),
    (
        "Today's weather.",
        {
            "type": "object",
            "properties": {
                "condition": {"enum": ["sunny", "cloudy", "rain", "snow"]},
                "celsius": {"type": "integer", "minimum": -60, "maximum": 60},
            },
            "required": ["condition", "celsius"],
        },
    ),
    (
        "Three colors.",
        {
            "type": "array",
            "items": {"enum": ["red", "green", "blue", "yellow", "black"]},
            "minItems": 3,
            "maxItems": 3,
        },
    ),
    (
        "A list of up to five numbers.",
        {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 99}, "maxItems": 5},
    ),
    (
        "A book with its author.",
        {
            "type": "object",
            "properties": {
                "title": SHORT,
                "author": {
                    "type": "object",
                    "properties": {"first": NAME, "last": NAME},
                    "required": ["first", "last"],
                },
                "year": {"type": "integer", "minimum": 1400, "maximum": 2030},
            },
            "required": ["title", "author", "year"],
        },
    ),
    (
        "A yes or no answer with a reason.",
        {
            "type": "object",
            "properties": {"answer": {"type": "boolean"}, "reason": SHORT},
            "required": ["answer", "reason"],
        },
    ),
    (
        "A point on a map.",
        {
            "$defs": {"coordinate": {"type": "number", "minimum": -180, "maximum": 180}},
            "type": "object",
            "properties": {
                "lat": {"$ref": "#/$defs/coordinate"},
                "lon": {"$ref": "#/$defs/coordinate"},
            },
            "required": ["lat", "lon"],
        },
    ),
    (
        "A team of two people.",
        {
            "$defs": {
                "member": {
                    "type": "object",
                    "properties": {"name": NAME, "role": {"enum": ["lead", "dev", "qa"]}},
                    "required": ["name", "role"],
                }
            },
            "type": "object",
            "properties": {
                "team": NAME,
                "members": {
                    "type": "array",
                    "items": {"$ref": "#/$defs/member"},
                    "minItems": 2,
                    "maxItems": 2,
                },
            },
            "required": ["team", "members"],
        },
    ),
    (
        "A folder tree.",
        {
            "$defs": {
                "node": {
                    "type": "object",
                    "properties": {
                        "name": NAME,
                        "children": {
                            "type": "array",
                            "items": {"$ref": "#/$defs/node"},
                            "maxItems": 2,
                        },
                    },
                    "required": ["name", "children"],
                }
            },
            "$ref": "#/$defs/node",
        },
    ),
    (
        "An HTTP status.",
        {
            "type": "object",
            "properties": {
                "code": {"enum": [200, 201, 400, 404, 500]},
                "message": SHORT,
            },
            "required": ["code", "message"],
        },
    ),
    (
        "A version number.",
        {
            "type": "object",
            "properties": {
                "major": {"type": "integer", "minimum": 0, "maximum": 20},
                "minor": {"type": "integer", "minimum": 0, "maximum": 50},
                "patch": {"type": "integer", "minimum": 0, "maximum": 99},
            },
            "required": ["major", "minor", "patch"],
            "additionalProperties": False,
        },
    ),
    (
        "A contact that may lack a phone.",
        {
            "type": "object",
            "properties": {"name": NAME, "phone": {"type": ["string", "null"], "maxLength": 16}},
            "required": ["name", "phone"],
        },
    ),
    (
        "Either a cat or a dog.",
        {
            "anyOf": [
                {
                    "type": "object",
                    "properties": {
                        "kind": {"const": "cat"},
                        "lives": {"type": "integer", "minimum": 1, "maximum": 9},
                    },
                    "required": ["kind", "lives"],
                },
                {
                    "type": "object",
                    "properties": {"kind": {"const": "dog"}, "breed": NAME},
                    "required": ["kind", "breed"],
                },
            ]
        },
    ),
    (
        "A meeting date.",
        {
            "type": "object",
            "properties": {"title": SHORT, "date": {"type": "string", "format": "date"}},
            "required": ["title", "date"],
        },
    ),
    (
        "A rating out of five.",
        {
            "type": "object",
            "properties": {
                "stars": {"type": "integer", "minimum": 1, "maximum": 5},
                "score": {"type": "number", "minimum": 0, "maximum": 1},
            },
            "required": ["stars", "score"],
        },
    ),
    (
        "A recipe.",
        {
            "type": "object",
            "properties": {
                "dish": NAME,
                "ingredients": {"type": "array", "items": NAME, "minItems": 1, "maxItems": 4},
                "minutes": {"type": "integer", "minimum": 1, "maximum": 300},
                "vegetarian": {"type": "boolean"},
            },
            "required": ["dish", "ingredients", "minutes", "vegetarian"],
        },
    ),
    (
        "A key-value settings object.",
        {
            "type": "object",
            "properties": {"debug": {"type": "boolean"}, "level": {"enum": ["low", "high"]}},
            "required": ["debug"],
            "additionalProperties": {"type": "integer", "minimum": 0, "maximum": 9},
        },
    ),
    (
        "A matrix of two rows.",
        {
            "type": "array",
            "items": {
                "type": "array",
                "items": {"type": "integer", "minimum": 0, "maximum": 9},
                "minItems": 2,
                "maxItems": 2,
            },
            "minItems": 2,
            "maxItems": 2,
        },
    ),
    (
        "An order with line items.",
        {
            "type": "object",
            "properties": {
                "id": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
                "items": {
                    "type": "array",
                    "items": {
                        "type": "object",
                        "properties": {
                            "sku": NAME,
                            "qty": {"type": "integer", "minimum": 1, "maximum": 10},
                        },
                        "required": ["sku", "qty"],
                    },
                    "minItems": 1,
                    "maxItems": 3,
                },
                "paid": {"type": "boolean"},
            },
            "required": ["id", "items", "paid"],
        },
    ),
]

REGEXES: list[tuple[str, str]] = [
    ("A phone number:", r"\(\d{3}\) \d{3}-\d{4}"),
    ("An email address:", r"[a-z]{1,12}@[a-z]{1,10}\.(com|org|net)"),
    ("A date:", r"20[0-9]{2}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])"),
    ("A hex color:", r"#[0-9a-f]{6}"),
    ("An IPv4 address:", r"((25[0-5]|2[0-4]\d|1?\d?\d)\.){3}(25[0-5]|2[0-4]\d|1?\d?\d)"),
]
