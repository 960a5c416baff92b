"""What a request may ask its output to match: a JSON schema, any JSON object, a regular
expression, a context-free grammar, or one of a list of strings.

A Constraint is a plain value, checked here for what can be checked without compiling it
(engine/structured/grammar.py compiles it for the model's tokenizer and turns it into token masks).
It names the request field it came from, so that every refusal, here or from the
compiler, says where the fault is in the caller's own terms.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Literal

from engine.errors import ValidationError

ConstraintKind = Literal["json_schema", "json_object", "regex", "grammar", "choice"]
CONSTRAINT_KINDS: tuple[ConstraintKind, ...] = (
    "json_schema",
    "json_object",
    "regex",
    "grammar",
    "choice",
)
MAX_SPEC_CHARS = 256 * 1024  # a schema, regex or grammar; bounded before it is parsed
MAX_CHOICES = 1024
MAX_CHOICE_CHARS = 4096


@dataclass(frozen=True)
class Constraint:
    kind: ConstraintKind
    # json_schema: the schema as JSON text; regex: the pattern; grammar: Lark as
    # llguidance reads it, or GBNF (`root ::= ...`); choice: the strings; json_object:
    # nothing.
    spec: str | tuple[str, ...] = ""
    # The request field it came from ("response_format.json_schema", "constraint.regex"):
    # what refusals name. Not part of its identity: equal constraints compile once.
    field: str = field(default="constraint", compare=False)

    def validate(self) -> None:
        """Raise ValidationError naming self.field for what is wrong short of compiling."""
        if self.kind not in CONSTRAINT_KINDS:
            raise ValidationError(
                self.field, f"unknown kind {self.kind!r}; expected one of {list(CONSTRAINT_KINDS)}"
            )
        if self.kind == "choice":
            self._validate_choices()
        elif self.kind != "json_object":
            if not isinstance(self.spec, str) or not self.spec.strip():
                raise ValidationError(self.field, "must be a non-empty string")
            if len(self.spec) > MAX_SPEC_CHARS:
                raise ValidationError(
                    self.field, f"has {len(self.spec)} characters, at most {MAX_SPEC_CHARS}"
                )
        if self.kind == "json_schema":
            try:
                schema = json.loads(self.spec)
            except ValueError as exc:
                raise ValidationError(self.field, f"is not valid JSON: {exc}") from exc
            if not isinstance(schema, (dict, bool)):
                raise ValidationError(
                    self.field,
                    f"a JSON Schema is an object or a boolean, got {type(schema).__name__}",
                )

    def _validate_choices(self) -> None:
        if not isinstance(self.spec, tuple) or not self.spec:
            raise ValidationError(self.field, "must list at least one string")
        if len(self.spec) > MAX_CHOICES:
            raise ValidationError(
                self.field, f"at most {MAX_CHOICES} choices, got {len(self.spec)}"
            )
        for i, choice in enumerate(self.spec):
            if not isinstance(choice, str) or not choice:
                raise ValidationError(self.field, f"entry {i} must be a non-empty string")
            if len(choice) > MAX_CHOICE_CHARS:
                raise ValidationError(
                    self.field,
                    f"entry {i} has {len(choice)} characters, at most {MAX_CHOICE_CHARS}",
                )
