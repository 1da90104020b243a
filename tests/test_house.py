"""The layout of the package: its stages, the direction of its imports, its sizes.

Every import is read (function-level ones included, as in `docs/design.md`): no
import circle, no chain of imports longer than 10 modules, no stage importing a
later one, no function-level import of the package's own modules, and no file
over 400 lines. The map at the top of `docs/design.md` lists exactly the
package's folders and modules.
"""

import ast
import re
from pathlib import Path

import pytest

import jaxtyping_shard as jts


ROOT = Path(__file__).resolve().parent.parent
# The package as imported: the source tree here, the installed wheel in CI's floor
# and newest runs (which run from the sdist without its jaxtyping_shard/ folder).
PACKAGE = Path(jts.__file__).resolve().parent
# The stages in the order data flows through them; a module may import from its
# own stage or an earlier one, never a later one.
STAGES = (
    "_core",
    "_rules",
    "_layout",
    "_verdict",
    "_annotation",
    "_trees",
    "_drivers",
    "_report",
)
MAX_CHAIN = 10
MAX_LINES = 400


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _is_package(name: str, modules: dict) -> bool:
    return modules[name].name == "__init__.py"


def _imports(name: str, path: Path, modules: dict) -> list[tuple[str, int, bool]]:
    """`(imported module, line, inside a function)` for every import of the
    package's own modules; an import of a package names the submodules it
    takes, else the package itself."""
    tree = ast.parse(path.read_text())
    here = name if _is_package(name, modules) else name.rpartition(".")[0]
    found = []

    def visit(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            inside = in_function or isinstance(
                child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)
            )
            if isinstance(child, ast.Import):
                for alias in child.names:
                    if alias.name.split(".")[0] == "jaxtyping_shard":
                        found.append((alias.name, child.lineno, inside))
            elif isinstance(child, ast.ImportFrom):
                if child.level:
                    base = here.split(".")
                    base = base[: len(base) - (child.level - 1)]
                    target = ".".join(base + ([child.module] if child.module else []))
                else:
                    target = child.module or ""
                if target.split(".")[0] != "jaxtyping_shard":
                    continue
                subs = [f"{target}.{a.name}" for a in child.names]
                subs = [s for s in subs if s in modules]
                for module in subs or [target]:
                    found.append((module, child.lineno, inside))
            visit(child, inside)

    visit(tree, False)
    return found


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {
        name: {target for target, _, _ in _imports(name, path, modules)}
        for name, path in modules.items()
    }


def _stage(name: str) -> int:
    parts = name.split(".")
    if len(parts) > 1 and parts[1] in STAGES:
        return STAGES.index(parts[1])
    return len(STAGES)  # the package's face: __init__, demo, pytest_plugin


def test_every_import_resolves_to_a_module():
    graph = _graph()
    for name, targets in graph.items():
        for target in targets:
            assert target in graph, f"{name} imports {target}, which is no module"


def test_no_import_circle():
    graph = _graph()
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        stack.append(node)
        for target in sorted(graph[node]):
            if state.get(target) == 1:
                circle = stack[stack.index(target) :] + [target]
                raise AssertionError("import circle: " + " -> ".join(circle))
            if target not in state:
                visit(target)
        stack.pop()
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node)


def test_no_chain_longer_than_ten_modules():
    graph = _graph()
    longest: dict[str, list[str]] = {}

    def chain(node: str) -> list[str]:
        if node not in longest:
            below = max((chain(t) for t in graph[node]), key=len, default=[])
            longest[node] = [node, *below]
        return longest[node]

    worst = max((chain(n) for n in graph), key=len)
    assert len(worst) <= MAX_CHAIN, " -> ".join(worst)


def test_stages_import_only_earlier_stages():
    wrong = [
        f"{name} -> {target}"
        for name, targets in _graph().items()
        for target in targets
        if _stage(target) > _stage(name)
    ]
    assert not wrong, wrong


def test_function_level_imports_are_of_others_only_and_say_why():
    modules = _modules()
    own = []
    for name, path in modules.items():
        own += [
            f"{name}:{line} -> {target}"
            for target, line, inside in _imports(name, path, modules)
            if inside
        ]
    assert not own, f"function-level imports of the package itself: {own}"
    unexplained = []
    for name, path in modules.items():
        lines = path.read_text().splitlines()
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for inner in ast.walk(node):
                if isinstance(inner, (ast.Import, ast.ImportFrom)):
                    text = lines[inner.lineno - 1] + lines[inner.lineno - 2]
                    if "#" not in text:
                        unexplained.append(f"{name}:{inner.lineno}")
    assert not unexplained, f"function-level imports without a reason: {unexplained}"


@pytest.mark.parametrize(
    "folder", ["jaxtyping_shard", "tests", "benchmarks", "examples"]
)
def test_no_file_over_400_lines(folder):
    top = PACKAGE.parent if folder == "jaxtyping_shard" else ROOT
    long = {
        str(p.relative_to(top)): n
        for p in sorted((top / folder).rglob("*.py"))
        if (n := len(p.read_text().splitlines())) > MAX_LINES
    }
    assert not long, long


def _design_map() -> set[str]:
    text = (ROOT / "docs" / "design.md").read_text()
    block = re.search(r"```text\njaxtyping_shard/\n(.*?)```", text, re.S)
    assert block, "docs/design.md opens with the map, a ```text block"
    paths, stack = set(), []
    for line in block.group(1).splitlines():
        match = re.match(r"( *)(\S+)", line)
        if not match:
            continue
        depth, entry = len(match.group(1)) // 2 - 1, match.group(2)
        del stack[depth:]
        if entry.endswith("/"):
            stack.append(entry)
        paths.add("".join(stack[: len(stack) - entry.endswith("/")]) + entry)
    return paths


def test_the_design_map_matches_the_code():
    actual = set()
    for p in PACKAGE.rglob("*"):
        if "__pycache__" in p.parts:
            continue
        if p.name == "__init__.py" and p.parent != PACKAGE:
            continue  # a stage's own __init__ holds only its docstring
        if p.is_dir() or p.suffix in (".py", ".typed"):
            rel = p.relative_to(PACKAGE).as_posix()
            actual.add(rel + "/" if p.is_dir() else rel)
    mapped = _design_map()
    assert mapped == actual, (
        f"in the map only: {sorted(mapped - actual)}; "
        f"in the code only: {sorted(actual - mapped)}"
    )


def test_dir_shows_the_public_api_only():
    assert dir(jts) == sorted(jts.__all__)
    assert "importlib" not in dir(jts) and "typing" not in dir(jts)
    for name in jts.__all__:
        assert getattr(jts, name).__module__.startswith(
            ("jaxtyping_shard", "builtins")
        ) or (name in ("get_mode", "set_mode")), name


def test_a_stage_package_holds_only_its_docstring():
    for init in sorted(PACKAGE.glob("*/**/__init__.py")):
        body = ast.parse(init.read_text()).body
        assert len(body) == 1 and isinstance(body[0], ast.Expr), init
        assert isinstance(body[0].value, ast.Constant), init
