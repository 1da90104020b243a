"""Check the sdist and wheel that `python -m build` made, against the source tree.

    python .ci/check_dist.py DIST_DIR

Run by .ci/run from the repository root, after `python -m build -o DIST_DIR` and
`twine check`. Every expectation is derived from the repository as git tracks it,
so a module or subpackage added later and missing from the wheel fails here
without this file naming it:

- DIST_DIR holds one wheel and one sdist, both of pyproject.toml's version;
- the wheel holds exactly the files git tracks under jaxtyping_shard/ (every
  module, every subpackage, the `py.typed` marker) and nothing else beside its
  .dist-info; its METADATA has the version and requires-python of pyproject.toml,
  and its entry_points.txt declares the pytest plugin
  (`[pytest11] jaxtyping_shard = jaxtyping_shard.pytest_plugin`);
- the sdist holds every file git tracks (tests, docs, examples, benchmarks,
  README.md, CHANGELOG.md, .ci/floors.txt: .ci/run runs the suite from it).

Prints what it checked; exits non-zero with every problem found.
"""

import configparser
import subprocess
import sys
import tarfile
import tomllib
import zipfile
from email.parser import HeaderParser
from pathlib import Path


PACKAGE = "jaxtyping_shard"
PLUGIN = ("pytest11", "jaxtyping_shard", "jaxtyping_shard.pytest_plugin")
MARKER = f"{PACKAGE}/py.typed"


def tracked(root: Path) -> set[str]:
    listed = subprocess.run(
        ["git", "ls-files", "-z"], cwd=root, capture_output=True, text=True, check=True
    ).stdout.split("\0")
    files = {f for f in listed if f and (root / f).is_file()}
    if not files:
        sys.exit(f"git ls-files lists no file in {root}: run from a git checkout")
    return files


def subpackages(files: set[str]) -> list[str]:
    return sorted(
        str(Path(f).parent).replace("/", ".")
        for f in files
        if f.startswith(f"{PACKAGE}/") and f.endswith("/__init__.py")
    )


def _one(dist: Path, pattern: str, problems: list[str]) -> Path | None:
    found = sorted(dist.glob(pattern))
    if len(found) != 1:
        problems.append(f"{dist} should hold one {pattern}, holds {found}")
        return None
    return found[0]


def check_wheel(
    wheel: Path, version: str, python: str, source: set[str], problems: list[str]
) -> None:
    info = f"{PACKAGE}-{version}.dist-info"
    with zipfile.ZipFile(wheel) as archive:
        names = {n for n in archive.namelist() if not n.endswith("/")}
        metadata = HeaderParser().parsestr(archive.read(f"{info}/METADATA").decode())
        entry_points = configparser.ConfigParser(delimiters=("=",))
        entry_points.optionxform = str  # type: ignore[assignment]  # keep case
        if f"{info}/entry_points.txt" in names:
            entry_points.read_string(archive.read(f"{info}/entry_points.txt").decode())
    shipped = {n for n in names if not n.startswith(f"{info}/")}
    expected = {f for f in source if f.startswith(f"{PACKAGE}/")}
    if MARKER not in expected:
        problems.append(f"{MARKER} is not in the source tree (git ls-files)")
    for name in sorted(expected - shipped):
        problems.append(f"wheel lacks {name}")
    for name in sorted(shipped - expected):
        problems.append(f"wheel holds {name}, which git does not track there")
    missing = sorted(set(subpackages(expected)) - set(subpackages(shipped)))
    if missing:
        problems.append(f"wheel lacks the subpackages {missing}")
    if metadata["Version"] != version:
        problems.append(f"wheel METADATA Version {metadata['Version']} != {version}")
    if metadata["Requires-Python"] != f">={python}":
        problems.append(
            f"wheel METADATA Requires-Python {metadata['Requires-Python']} != "
            f">={python}"
        )
    group, name, target = PLUGIN
    if not entry_points.has_section(group):
        problems.append(f"wheel entry_points.txt has no [{group}] section")
    elif entry_points[group].get(name, "").strip() != target:
        problems.append(
            f"wheel entry_points.txt [{group}] {dict(entry_points[group])} does not "
            f"declare {name} = {target}"
        )
    print(
        f"{wheel.name}: {len(shipped)} files under {PACKAGE}/, "
        f"subpackages {subpackages(shipped)}, {MARKER}: "
        f"{'yes' if MARKER in shipped else 'NO'}, [{group}] {name} = "
        f"{entry_points[group].get(name) if entry_points.has_section(group) else None}"
    )


def check_sdist(sdist: Path, version: str, source: set[str], problems: list[str]):
    top = f"{PACKAGE}-{version}/"
    with tarfile.open(sdist) as archive:
        members = [m for m in archive.getmembers() if m.isfile()]
        outside = [m.name for m in members if not m.name.startswith(top)]
        names = {m.name.removeprefix(top) for m in members}
        info = archive.extractfile(f"{top}PKG-INFO")
        metadata = HeaderParser().parsestr(info.read().decode()) if info else {}
    if outside:
        problems.append(f"sdist holds files outside {top}: {outside[:5]}")
    for name in sorted(source - names):
        problems.append(f"sdist lacks {name}")
    if metadata.get("Version") != version:
        problems.append(
            f"sdist PKG-INFO Version {metadata.get('Version')} != {version}"
        )
    folders = sorted({n.split("/")[0] + "/" for n in names if "/" in n})
    print(f"{sdist.name}: {len(names)} files, every tracked one; folders {folders}")


def main() -> None:
    (dist,) = (Path(a) for a in sys.argv[1:])
    root = Path(__file__).resolve().parent.parent
    project = tomllib.loads((root / "pyproject.toml").read_text())["project"]
    version = project["version"]
    python = project["requires-python"].removeprefix(">=")
    source = tracked(root)
    problems: list[str] = []
    wheel = _one(dist, f"{PACKAGE}-{version}-py3-none-any.whl", problems)
    sdist = _one(dist, f"{PACKAGE}-{version}.tar.gz", problems)
    others = {p.name for p in dist.iterdir()} - {p.name for p in (wheel, sdist) if p}
    if others:
        problems.append(f"{dist} holds more than one sdist and one wheel: {others}")
    if wheel:
        check_wheel(wheel, version, python, source, problems)
    if sdist:
        check_sdist(sdist, version, source, problems)
    if problems:
        sys.exit("the built distributions are wrong:\n  " + "\n  ".join(problems))
    print(f"sdist and wheel of jaxtyping-shard {version}: as the source tree says")


if __name__ == "__main__":
    main()
