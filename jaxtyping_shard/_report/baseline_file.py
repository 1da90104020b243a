"""The JSON file both baselines are kept in (`Collectives.save`, `Layouts.save`):
a format string, the function's name, and one section per JAX release, each a
few fields and a list of entries, one entry a line, so that a change to the
baseline reads as a diff of the lines it changes.
"""

import json
import os
from typing import Union

from .._core import compat as _compat


PathLike = Union[str, "os.PathLike[str]"]


def write(
    path: PathLike, format: str, function: str, sections: dict, listed: str
) -> None:
    """Writes `sections` (release -> fields, `listed` the list of entries), the
    releases in version order and each entry on a line of its own."""
    lines = [
        "{",
        f' "format": "{format}",',
        f' "function": {json.dumps(function)},',
        ' "jax": {',
    ]
    versions = sorted(sections, key=_compat._version)
    for i, version in enumerate(versions):
        section = dict(sections[version])
        entries = section.pop(listed)
        head = json.dumps(section)[:-1] + f', "{listed}": ['
        lines.append(f"  {json.dumps(version)}: {head}")
        lines += [
            "   " + json.dumps(e) + ("," if j < len(entries) - 1 else "")
            for j, e in enumerate(entries)
        ]
        lines.append("  ]}" + ("," if i < len(versions) - 1 else ""))
    lines += [" }", "}"]
    with open(path, "w", encoding="utf-8") as file:
        file.write("\n".join(lines) + "\n")


def read(path: PathLike, formats: tuple[str, ...], what: str, by: str) -> dict:
    """The file at `path`, refused unless it is one of `formats` with sections:
    `what` names the baseline and `by` its writer in the error."""
    with open(path, encoding="utf-8") as file:
        data = json.load(file)
    if (
        not isinstance(data, dict)
        or data.get("format") not in formats
        or not isinstance(data.get("jax"), dict)
    ):
        raise ValueError(
            f"{os.fspath(path)} is not a baseline of {what} ({formats[0]!r}, "
            f"written by `{by}`)"
        )
    return data
