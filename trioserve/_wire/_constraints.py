"""What every dialect's structured output becomes: a JSON Schema, held to the server's
schema limit, as the engine's :class:`~trioserve._core._types.Constraint`. The fields
that ask for it are each dialect's own (``response_format``, ``output_config.format``,
``text.format``); the conversion is written once, here."""

from __future__ import annotations

from .._core._types import Constraint
from ._limits import RequestLimits

__all__ = ["ANY_OBJECT", "json_schema_constraint"]

#: the schema of a bare ``json_object`` request: any JSON object
ANY_OBJECT = '{"type": "object"}'


def json_schema_constraint(source: str, param: str, limits: RequestLimits) -> Constraint:
    """The constraint a schema (``source``, as JSON) asks for; a schema larger than
    ``limits`` allow is a 400 naming ``param``."""
    limits.check_schema(source, param)
    return Constraint(kind="json_schema", source=source)
