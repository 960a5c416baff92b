"""JSON schemas of varied shape, each with a prompt that asks for it (a helper, not tests):
what the structured-output tests generate against and the benchmark compiles.

Together they cover nested objects, arrays with bounds, enums and const, numbers with
bounds, required and optional properties, additionalProperties, patternProperties with
maxProperties, $ref/$defs (a recursion unrolled to a fixed depth too), anyOf, nullable
types, string formats and a pattern.

Every schema is bounded, so that a whole document always fits in max_tokens: a small
model given room keeps writing, and a document cut off by max_tokens does not parse (the
constraint holds either way, but the answer ends with "length", not "stop"). So every
object is closed ("additionalProperties": false: an open object lets the model add
properties until it runs out of tokens), extra keys come only through a patternProperties
with short keys and a maxProperties, strings carry a maxLength, arrays a maxItems, the
folder tree is a $ref chain of fixed depth (node -> child -> leaf; a truly recursive one
nests without end), and numbers are integers or carry a multipleOf that bounds their
digits, except two fractions with tight bounds, which the model ends quickly.
"""

from __future__ import annotations

import json
from typing import Any

NAME = {"type": "string", "maxLength": 16}
SHORT = {"type": "string", "maxLength": 24}


def closed(properties: dict[str, Any], required: list[str] | None = None) -> dict[str, Any]:
    """An object of exactly these properties (all required unless `required` says which)."""
    return {
        "type": "object",
        "properties": properties,
        "required": list(properties) if required is None else required,
        "additionalProperties": False,
    }


SCHEMAS: list[tuple[str, dict[str, Any]]] = [
    (
        "A person with a name and an age.",
        closed({"name": NAME, "age": {"type": "integer", "minimum": 0, "maximum": 130}}),
    ),
    (
        "A product with a price in dollars.",
        closed(
            {
                "title": SHORT,
                "price": {"type": "number", "minimum": 0, "maximum": 10000},
                "in_stock": {"type": "boolean"},
            }
        ),
    ),
    (
        "Today's weather.",
        closed(
            {
                "condition": {"enum": ["sunny", "cloudy", "rain", "snow"]},
                "celsius": {"type": "integer", "minimum": -60, "maximum": 60},
            }
        ),
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
        closed(
            {
                "title": SHORT,
                "author": closed({"first": NAME, "last": NAME}),
                "year": {"type": "integer", "minimum": 1400, "maximum": 2030},
            }
        ),
    ),
    (
        "A yes or no answer with a reason.",
        closed({"answer": {"type": "boolean"}, "reason": SHORT}),
    ),
    (
        "A point on a map.",
        {
            "$defs": {
                "coordinate": {
                    "type": "number",
                    "minimum": -180,
                    "maximum": 180,
                    "multipleOf": 0.25,
                }
            },
            **closed(
                {"lat": {"$ref": "#/$defs/coordinate"}, "lon": {"$ref": "#/$defs/coordinate"}}
            ),
        },
    ),
    (
        "A team of two people.",
        {
            "$defs": {"member": closed({"name": NAME, "role": {"enum": ["lead", "dev", "qa"]}})},
            **closed(
                {
                    "team": NAME,
                    "members": {
                        "type": "array",
                        "items": {"$ref": "#/$defs/member"},
                        "minItems": 2,
                        "maxItems": 2,
                    },
                }
            ),
        },
    ),
    (
        "A folder tree.",
        {
            "$defs": {
                "node": closed(
                    {
                        "name": NAME,
                        "children": {
                            "type": "array",
                            "items": {"$ref": "#/$defs/child"},
                            "maxItems": 2,
                        },
                    }
                ),
                "child": closed(
                    {
                        "name": NAME,
                        "children": {
                            "type": "array",
                            "items": {"$ref": "#/$defs/leaf"},
                            "maxItems": 2,
                        },
                    }
                ),
                "leaf": closed({"name": NAME}),
            },
            "$ref": "#/$defs/node",
        },
    ),
    (
        "An HTTP status.",
        closed({"code": {"enum": [200, 201, 400, 404, 500]}, "message": SHORT}),
    ),
    (
        "A version number.",
        closed(
            {
                "major": {"type": "integer", "minimum": 0, "maximum": 20},
                "minor": {"type": "integer", "minimum": 0, "maximum": 50},
                "patch": {"type": "integer", "minimum": 0, "maximum": 99},
            }
        ),
    ),
    (
        "A contact that may lack a phone.",
        closed({"name": NAME, "phone": {"type": ["string", "null"], "maxLength": 16}}),
    ),
    (
        "Either a cat or a dog.",
        {
            "anyOf": [
                closed(
                    {
                        "kind": {"const": "cat"},
                        "lives": {"type": "integer", "minimum": 1, "maximum": 9},
                    }
                ),
                closed({"kind": {"const": "dog"}, "breed": NAME}),
            ]
        },
    ),
    (
        "A meeting date, maybe with a room.",
        closed(
            {"title": SHORT, "date": {"type": "string", "format": "date"}, "room": NAME},
            required=["title", "date"],
        ),
    ),
    (
        "A rating out of five.",
        closed(
            {
                "stars": {"type": "integer", "minimum": 1, "maximum": 5},
                "score": {"type": "number", "minimum": 0, "maximum": 1},
            }
        ),
    ),
    (
        "A recipe.",
        closed(
            {
                "dish": NAME,
                "ingredients": {"type": "array", "items": NAME, "minItems": 1, "maxItems": 4},
                "minutes": {"type": "integer", "minimum": 1, "maximum": 300},
                "vegetarian": {"type": "boolean"},
            }
        ),
    ),
    (
        "A key-value settings object.",
        {
            **closed({"debug": {"type": "boolean"}, "level": {"enum": ["low", "high"]}}),
            "patternProperties": {
                "^x_[a-z]{1,10}$": {"type": "integer", "minimum": 0, "maximum": 9}
            },
            "maxProperties": 4,
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
        closed(
            {
                "id": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
                "items": {
                    "type": "array",
                    "items": closed(
                        {"sku": NAME, "qty": {"type": "integer", "minimum": 1, "maximum": 10}}
                    ),
                    "minItems": 1,
                    "maxItems": 3,
                },
                "paid": {"type": "boolean"},
            }
        ),
    ),
]

REGEXES: list[tuple[str, str]] = [
    ("A phone number:", r"\(\d{3}\) \d{3}-\d{4}"),
    ("An email address:", r"[a-z]{1,12}@[a-z]{1,10}\.(com|org|net)"),
    ("A date:", r"20[0-9]{2}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])"),
    ("A hex color:", r"#[0-9a-f]{6}"),
    ("An IPv4 address:", r"((25[0-5]|2[0-4]\d|1?\d?\d)\.){3}(25[0-5]|2[0-4]\d|1?\d?\d)"),
]


def slow_schema(properties: int, name: str = "p") -> str:
    """A schema whose grammar takes llguidance long to build, as JSON: an object of
    `properties` optional strings, every subset and order of which it must allow (on one
    CPU core: 1,000 ~0.06 s, 2,000 ~0.2 s, 8,000 ~3.3 s in 207 KB). Another `name` makes
    another schema."""
    strings = {f"{name}{i}": {"type": "string"} for i in range(properties)}
    return json.dumps({"type": "object", "properties": strings}, separators=(",", ":"))


# Two long required keys and a digit each: most of a document is text the schema fixes,
# tokens a grammar forces one after another.
FIXED_KEYS = ["the_first_rather_long_property_name", "a_second_even_longer_property_name"]
FIXED_KEYS_SCHEMA = {
    "type": "object",
    "properties": dict.fromkeys(FIXED_KEYS, {"type": "integer", "minimum": 0, "maximum": 9}),
    "required": FIXED_KEYS,
    "additionalProperties": False,
}
