"""Inline sharding in the dim string (`"batch@data seq"`): placeholder until the
parser lands; for now only dim strings without `@` are accepted."""

from typing import Optional

from . import _spec
from ._errors import ShardingAnnotationError


def parse_dims(dim_str: str, where: str) -> tuple[str, Optional[_spec.Layout]]:
    if not isinstance(dim_str, str) or "@" not in dim_str:
        return dim_str, None
    raise ShardingAnnotationError(f"{where}: inline `@` sharding is not supported yet")
