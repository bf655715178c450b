"""Cross-field rules, written once and enforced twice.

Each rule carries its CEL expression (the API server checks it, as an
`x-kubernetes-validations` entry in the generated CRD) and the same check in Python (pydantic
runs it when the operator parses a spec). tests/operator/test_invalid_resources.py feeds the
same table of bad resources to both, so the two cannot drift apart unnoticed.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, ValidationError, model_validator
from pydantic.alias_generators import to_camel
from pydantic_core import PydanticCustomError


@dataclass(frozen=True)
class CrossFieldRule:
    cel: str  # evaluated by the API server with `self` bound to the object
    message: str  # shown to the user by both the API server and pydantic
    check: Callable[[Any], bool]  # the same rule in Python, given the pydantic model
    field_path: str = ""  # e.g. ".blockSize": where the API server reports a failure

    def as_validation(self) -> dict[str, str]:
        entry = {"rule": self.cel, "message": self.message}
        if self.field_path:
            entry["fieldPath"] = self.field_path
        return entry


def _add_rules_to_schema(schema: dict[str, Any], model: type[Any]) -> None:
    rules: tuple[CrossFieldRule, ...] = getattr(model, "cross_field_rules", ())
    if rules:
        schema["x-kubernetes-validations"] = [rule.as_validation() for rule in rules]


class ApiModel(BaseModel):
    """Base of every resource model: camelCase on the wire, unknown fields refused."""

    model_config = ConfigDict(
        alias_generator=to_camel,
        validate_by_name=True,
        validate_by_alias=True,
        extra="forbid",
        json_schema_extra=_add_rules_to_schema,
    )

    # Subclasses list the rules that relate their own fields.
    cross_field_rules: ClassVar[tuple[CrossFieldRule, ...]] = ()

    @model_validator(mode="after")
    def _check_cross_field_rules(self) -> ApiModel:
        for rule in type(self).cross_field_rules:
            if not rule.check(self):
                raise PydanticCustomError(
                    "cross_field", "{message}", {"message": rule.message, "field_path": rule.field_path}
                )
        return self


def describe_validation_error(exc: ValidationError, prefix: str = "spec") -> str:
    """One line per problem, each naming the field as the API server would (`spec.kvTransfer.blockSize`)."""
    lines = []
    for error in exc.errors():
        path = prefix + "".join(f"[{part}]" if isinstance(part, int) else f".{part}" for part in error["loc"])
        field_path = (error.get("ctx") or {}).get("field_path", "")
        lines.append(f"{path}{field_path}: {error['msg']}")
    return "; ".join(lines)
