"""Find the `Duration` fields of a pydantic model tree (config and policy duration tests)."""

from __future__ import annotations

import types
from typing import Annotated, Any, Union, get_args, get_origin

from pydantic import BaseModel

from proxy.policy.vocab import Duration

_VALIDATOR = get_args(Duration)[1]

# A path through the model tree; "*" stands for any member of a dict field.
Path = tuple[str, ...]


def _is_duration(annotation: Any, metadata: list[Any]) -> bool:
    return _VALIDATOR in metadata or Duration in get_args(annotation) or annotation == Duration


def _models(annotation: Any) -> list[tuple[Path, type[BaseModel]]]:
    """The models an annotation holds, with the path segments that lead into them."""
    origin = get_origin(annotation)
    if origin is Annotated:
        return _models(get_args(annotation)[0])
    if origin in (Union, types.UnionType):
        return [m for arg in get_args(annotation) for m in _models(arg)]
    if origin is dict:
        return [(("*", *seg), m) for seg, m in _models(get_args(annotation)[1])]
    if origin is list:
        return []  # no duration lives in a list item today; a walk here would need an index
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [((), annotation)]
    return []


def duration_fields(model: type[BaseModel], prefix: Path = ()) -> list[Path]:
    """Every path below `model` whose field is typed `Duration` or `Duration | None`."""
    found: list[Path] = []
    for name, field in model.model_fields.items():
        key = field.alias or name
        if _is_duration(field.annotation, field.metadata):
            found.append((*prefix, key))
            continue
        for segments, inner in _models(field.annotation):
            found += duration_fields(inner, (*prefix, key, *segments))
    return found
