"""The docs stay true to the code: a short front page, every package in ARCHITECTURE.md, every module, file and
folder ARCHITECTURE.md and EXTENDING.md name exists, the five recipes."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.support.env import REPO

pytestmark = pytest.mark.guard  # scripts/guards.sh: runs before any test that trains

RECIPES = (
    "Add an RL algorithm",
    "Add a logging sink",
    "Add a stage",
    "Add a Hugging Face family",
    "Add a data format",
)


def packages() -> list[str]:
    """Every package of the product, dotted (pipeline.schema, engine.data.formats, ...)."""
    found = []
    for top in ("pipeline", "stages", "engine"):
        for init in sorted((REPO / top).rglob("__init__.py")):
            found.append(".".join(init.parent.relative_to(REPO).parts))
    return found


def test_readme_is_a_front_page() -> None:
    lines = (REPO / "README.md").read_text().splitlines()
    assert len(lines) <= 200, f"README.md has {len(lines)} lines; the manual lives in docs/"


def test_architecture_describes_every_package() -> None:
    text = (REPO / "docs" / "ARCHITECTURE.md").read_text()
    missing = [p for p in packages() if p not in text and p.replace(".", "/") + "/" not in text]
    assert missing == [], f"docs/ARCHITECTURE.md does not mention: {missing}"


def test_extending_has_the_recipes() -> None:
    text = (REPO / "docs" / "EXTENDING.md").read_text()
    headings = {line[3:].strip() for line in text.splitlines() if line.startswith("## ")}
    assert set(RECIPES) <= headings, sorted(set(RECIPES) - headings)


def test_every_page_is_in_the_site() -> None:
    nav = (REPO / "mkdocs.yml").read_text()
    pages = sorted(p.name for p in (REPO / "docs").glob("*.md"))
    assert [p for p in pages if p not in nav] == []


# ---------------------------------------------------------------------------- the paths the docs name

ROOTS = ("pipeline", "stages", "engine", "tests", "bench", "slurm", "scripts", "conf", "docs")
"""The checkout's folders: a path token starting with one of them names a file or folder that must exist."""
PACKAGES = ("pipeline", "stages", "engine")
"""Dotted names starting with these are modules (a trailing attribute must be defined in its module)."""
TOKEN = re.compile(r"[\w./<>{}*-]+")
"""Path-like runs of characters; ``<name>``, ``{a,b}`` and ``*`` mark patterns, which are not checked."""


def _module_source(parts: list[str]) -> tuple[Path, list[str]] | None:
    """The longest module prefix of a dotted name: (its source file, the attributes after it)."""
    for i in range(len(parts), 0, -1):
        base = REPO.joinpath(*parts[:i])
        source = base / "__init__.py" if base.is_dir() else base.with_suffix(".py")
        if source.is_file():
            return source, parts[i:]
    return None


def _dotted_exists(name: str) -> bool:
    """``pipeline.submit.launch`` is a module; ``pipeline.submit.launch.run_stage`` also names run_stage in it."""
    found = _module_source(name.split("."))
    if found is None:
        return False
    source, rest = found
    return not rest or re.search(rf"\b{re.escape(rest[0])}\b", source.read_text()) is not None


def _blocks(text: str) -> list[tuple[list[str], list[tuple[int, str]]]]:
    """(heading tokens in scope, the block's (line, token)s) per block: a bullet, a paragraph or a code block."""
    headings: dict[int, list[str]] = {}
    blocks: list[tuple[list[str], list[tuple[int, str]]]] = []
    current: list[tuple[int, str]] = []
    for n, line in enumerate(text.splitlines(), 1):
        if line.startswith(("#", "- ")) or not line.strip():
            blocks.append(([t for level in sorted(headings) for t in headings[level]], current))
            current = []
        if line.startswith("#"):
            level = len(line) - len(line.lstrip("#"))
            headings = {k: v for k, v in headings.items() if k < level}
            headings[level] = TOKEN.findall(line)
            continue
        current += [(n, m.group().rstrip(".")) for m in TOKEN.finditer(line)]
    blocks.append(([t for level in sorted(headings) for t in headings[level]], current))
    return blocks


def _dotted(token: str) -> bool:
    """A dotted name of the project (``pipeline.submit.launch``), not a file name or a config key."""
    return "/" not in token and not token.endswith(".py") and "." in token and token.split(".")[0] in PACKAGES


def _resolve(token: str, bases: list[Path]) -> Path | None:
    """Where a path token lies: under the checkout for a full path, else under a folder named before it."""
    if token.split("/")[0] in ROOTS:
        return REPO / token if (REPO / token).exists() else None
    return next((b / token for b in bases if (b / token).exists()), None)


def _folder(token: str, bases: list[Path]) -> Path | None:
    """The checkout's folder a token names or lies in (a package, a folder, a file's folder, a pattern's
    fixed part: ``engine/rl/<name>.py`` -> engine/rl), which the names after it may be relative to."""
    if _dotted(token):
        where: Path | None = REPO.joinpath(*token.split("."))
    elif "/" in token or token.endswith(".py"):
        where = _resolve(re.split(r"[<>{}*]", token)[0], bases)
    else:
        return None
    if where is None or not where.exists():
        return None
    return where if where.is_dir() else where.parent


def _is_path(token: str, bases: list[Path]) -> bool:
    """Whether a token names a file or folder of the checkout: a full path, a module, a folder, or a path under
    a folder the text named (``run_dir/...``, ``text_train.bin/.idx`` and other run files are not checked)."""
    if token.split("/")[0] in ROOTS or token.endswith(".py") or token.count("/") == 1 and token.endswith("/"):
        return True
    return "/" in token and any((b / token.split("/")[0]).is_dir() for b in bases)


def _missing(token: str, bases: list[Path]) -> bool:
    if any(c in token for c in "<>{}*") or token.startswith(("/", ".")):
        return False  # a pattern, an absolute path or a URL's tail, a file suffix
    if _dotted(token):
        return not _dotted_exists(token)
    return _is_path(token, bases) and _resolve(token, bases) is None


def missing_paths(doc: Path) -> list[str]:
    """Every module, file or folder ``doc`` names that is not in the checkout, as ``line N: token``; a name
    without a folder (``launch.py``, ``checkpoint/``) is looked up under the folders its block or heading
    named before it."""
    missing = []
    for heading, tokens in _blocks(doc.read_text()):
        bases = [REPO / t for t in heading if t in ROOTS]
        bases += [f for t in heading if (f := _folder(t, bases)) is not None]
        for n, token in tokens:
            if _missing(token, bases):
                missing.append(f"line {n}: {token}")
            elif (folder := _folder(token, bases)) is not None:
                bases.append(folder)
    return missing


@pytest.mark.parametrize("doc", ["ARCHITECTURE.md", "EXTENDING.md"])
def test_every_path_the_doc_names_exists(doc: str) -> None:
    missing = missing_paths(REPO / "docs" / doc)
    assert missing == [], f"docs/{doc} names what is not in the checkout:\n" + "\n".join(missing)


def test_the_path_check_tells_names_from_other_text(tmp_path: Path) -> None:
    doc = tmp_path / "doc.md"
    doc.write_text(
        "### `stages`: the stage modules\n\n"
        "`data_prep.py` (now a package), `pretrain.py`, `stages/<name>.py`, `run_dir/stages/data_prep/`.\n\n"
        "- `pipeline.submit`: `launch.py`, `gpt.py`, `preflight/` (`checks.py`), `pipeline.submit.launch.nope`,\n"
        "  `pipeline.submit.launch.run_stage`, `engine.models.gpt`, `engine/rl/<name>.py` (`dpo.py`), `rlhf.beta`,\n"
        "  https://example.org/a/b.py, `~/data/corpus.txt`, `text_train.bin/.idx`, `tests/nowhere.py`.\n"
    )
    assert missing_paths(doc) == [
        "line 3: data_prep.py",
        "line 5: gpt.py",
        "line 5: pipeline.submit.launch.nope",
        "line 7: tests/nowhere.py",
    ]
