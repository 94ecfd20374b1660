"""The docs stay true to the code: a short front page, every package in ARCHITECTURE.md, the five recipes."""

from __future__ import annotations

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
