"""Every ```python block of README.md and docs/*.md runs as pasted.

The blocks of one page run in order in one namespace, like a notebook, in a fresh
interpreter with 8 forced CPU devices (a subprocess, so the device count is set
before JAX starts). A block that is not meant to run (a traceback, a shell
command, a signature sketch) is fenced as ```text, ```bash or ```pycon instead.
"""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest


ROOT = Path(__file__).resolve().parent.parent
PAGES = sorted(
    [ROOT / "README.md", *(ROOT / "docs").glob("*.md")],
    key=lambda p: p.relative_to(ROOT).as_posix(),
)
_FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<ticks>`{3,}|~{3,})(?P<info>.*)$")

_RUNNER = r"""
import json, os, shutil, sys, tempfile, traceback, types

page = json.load(sys.stdin)
# The page as a script: its Python lines where they are, every other line blank,
# so line numbers are the page's and tools that read the source (typeguard's
# @typechecked, inspect) find it, as in a script the blocks were pasted into.
lines = [""] * page["length"]
for block in page["blocks"]:
    for i, text in enumerate(block["source"].splitlines()):
        lines[block["line"] - 1 + i] = text
folder = tempfile.mkdtemp(prefix="docs-examples-")
path = os.path.join(folder, page["name"].replace("/", "__") + ".py")
with open(path, "w", encoding="utf-8") as f:
    f.write("\n".join(lines) + "\n")
main = types.ModuleType("__main__")
main.__file__ = path
sys.modules["__main__"] = main
try:
    for block in page["blocks"]:
        source = "\n" * (block["line"] - 1) + block["source"]
        try:
            exec(compile(source, path, "exec"), main.__dict__)
        except BaseException as error:
            # Without this runner's own frame: the page's lines only.
            tb = error.__traceback__.tb_next
            text = "".join(traceback.format_exception(type(error), error, tb))
            failure = {"line": block["line"], "traceback": text}
            print("\n@@FAILED@@" + json.dumps(failure))
            sys.exit(1)
finally:
    shutil.rmtree(folder, ignore_errors=True)
"""


def python_blocks(text: str) -> list[tuple[int, str]]:
    """The ```python blocks of a Markdown page: (line of the first code line, code).

    Indented blocks (inside list items or admonitions) are dedented by their
    fence's indentation. Only the info string `python` counts; `py`, `pycon`,
    `text`, `bash` and unlabelled fences are not run.
    """
    blocks: list[tuple[int, str]] = []
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        opening = _FENCE.match(lines[i])
        if opening is None:
            i += 1
            continue
        indent, ticks = opening["indent"], opening["ticks"]
        language = opening["info"].strip().split(" ")[0].lower()
        body: list[str] = []
        i += 1
        while i < len(lines):
            closing = _FENCE.match(lines[i])
            if (
                closing is not None
                and closing["ticks"][0] == ticks[0]
                and len(closing["ticks"]) >= len(ticks)
                and not closing["info"].strip()
            ):
                break
            line = lines[i]
            body.append(line[len(indent) :] if line.startswith(indent) else line)
            i += 1
        else:
            raise ValueError(f"a {ticks} fence opened at line {i} is never closed")
        start = i - len(body) + 1  # 1-based line number of the first code line
        if language == "python":
            blocks.append((start, "\n".join(body) + "\n"))
        i += 1
    return blocks


def _env() -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("JAX_NUM_CPU_DEVICES", "JAXTYPING_SHARD_MODE", "JAX_PLATFORMS")
    }
    flags = [
        f
        for f in env.get("XLA_FLAGS", "").split()
        if not f.startswith("--xla_force_host_platform_device_count")
    ]
    env["XLA_FLAGS"] = " ".join([*flags, "--xla_force_host_platform_device_count=8"])
    env["JAX_PLATFORMS"] = "cpu"
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p
    )
    return env


def _run_page(page: Path) -> subprocess.CompletedProcess:
    text = page.read_text(encoding="utf-8")
    blocks = [{"line": line, "source": source} for line, source in python_blocks(text)]
    request = {
        "name": page.relative_to(ROOT).as_posix(),
        "length": len(text.splitlines()),
        "blocks": blocks,
    }
    return subprocess.run(
        [sys.executable, "-c", _RUNNER],
        input=json.dumps(request),
        cwd=ROOT,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )


def _failure_message(page: Path, out: subprocess.CompletedProcess) -> str:
    name = page.relative_to(ROOT).as_posix()
    marker = out.stdout.rfind("@@FAILED@@")
    if marker < 0:
        return (
            f"{name}: its ```python blocks did not run (exit {out.returncode}):\n"
            f"{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
        )
    failure = json.loads(out.stdout[marker + len("@@FAILED@@") :].splitlines()[0])
    line = failure["line"]
    first = page.read_text(encoding="utf-8").splitlines()[line - 1].strip()
    return (
        f"{name}: the ```python block at line {line}, starting `{first}`, fails "
        "when run as pasted (blocks of a page run in order in one namespace, with "
        "8 CPU devices; fence a block that is not meant to run as ```text, "
        f"```bash or ```pycon):\n{failure['traceback']}"
    )


PAGES_WITH_CODE = [p for p in PAGES if python_blocks(p.read_text(encoding="utf-8"))]


@pytest.mark.parametrize(
    "page",
    PAGES_WITH_CODE,
    ids=[p.relative_to(ROOT).as_posix() for p in PAGES_WITH_CODE],
)
def test_page_runs_as_pasted(page):
    out = _run_page(page)
    if out.returncode != 0:
        pytest.fail(_failure_message(page, out), pytrace=False)


def test_every_page_is_collected():
    names = {p.relative_to(ROOT).as_posix() for p in PAGES_WITH_CODE}
    assert {"README.md", "docs/getting-started.md", "docs/shard_map.md"} <= names


def test_block_extraction():
    page = (
        "# t\n"
        "```python\n"
        "a = 1\n"
        "```\n"
        "```text\n"
        "not run\n"
        "```\n"
        "- item\n"
        "\n"
        "    ```python\n"
        "    b = a + 1\n"
        "\n"
        "    c = b\n"
        "    ```\n"
        "````python\n"
        "```\n"
        "````\n"
        "```bash\n"
        "echo\n"
        "```\n"
    )
    assert python_blocks(page) == [
        (3, "a = 1\n"),
        (11, "b = a + 1\n\nc = b\n"),
        (16, "```\n"),
    ]


def test_failure_names_page_line_and_first_line(tmp_path, monkeypatch):
    page = tmp_path / "page.md"
    page.write_text(
        "```python\nx = 1\n```\n\n```python\nimport nothing_here_at_all\n```\n"
    )
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    out = _run_page(page)
    assert out.returncode != 0
    message = _failure_message(page, out)
    assert message.startswith(
        "page.md: the ```python block at line 6, starting `import nothing_here_at_all`"
    )
    assert re.search(r'File ".*page\.md\.py", line 6', message)
    assert "ModuleNotFoundError" in message


def test_blocks_share_one_namespace_with_8_devices(tmp_path, monkeypatch):
    page = tmp_path / "page.md"
    page.write_text(
        "```python\nimport jax\nn = len(jax.devices())\n```\n"
        "```python\nassert n == 8 and __name__ == '__main__', n\n```\n"
    )
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    out = _run_page(page)
    assert out.returncode == 0, _failure_message(page, out)
