"""The documentation holds together: README.md stays a front door (at most 200 lines, the test
command where .ci/run finds it), and every relative link in it and in docs/*.md reaches a file
that exists (and, where it names a section, a heading of that file)."""
from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from conftest import REPO

PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def prose(page: Path) -> str:
    """The page without its code: indented and fenced blocks and inline code spans."""
    text = re.sub(r"^```.*?^```", "", page.read_text(), flags=re.S | re.M)
    text = "\n".join(line for line in text.splitlines() if not line.startswith("    "))
    return re.sub(r"`[^`]*`", "", text)


def slug(heading: str) -> str:
    """A heading's anchor as GitHub makes it: lower case, punctuation dropped, spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    return {slug(line.lstrip("#").replace("`", "")) for line in page.read_text().splitlines() if line.startswith("#")}


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_relative_links_reach_a_file(page):
    broken = []
    for target in LINK.findall(prose(page)):
        if re.match(r"[a-z]+:", target):  # https:, mailto:
            continue
        path, _, section = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists():
            broken.append(f"{target}: no such file")
        elif section and file.suffix == ".md" and section not in anchors(file):
            broken.append(f"{target}: no heading #{section} in {file.relative_to(REPO)}")
    assert not broken, f"{page.relative_to(REPO)}: " + "; ".join(broken)


def test_every_doc_links_back_to_the_readme():
    assert all("](../README.md)" in page.read_text() for page in PAGES[1:])


def test_readme_is_a_front_door():
    lines = (REPO / "README.md").read_text().splitlines()
    assert len(lines) <= 200, f"README.md has {len(lines)} lines: move details to docs/"


def test_ci_finds_the_test_command_in_the_readme():
    """.ci/run's own line that reads the test command out of README.md, run as it is."""
    line = next(line for line in (REPO / ".ci" / "run").read_text().splitlines() if line.startswith("test_command="))
    found = subprocess.run(["bash", "-c", f'{line}\nprintf %s "$test_command"'], cwd=REPO, capture_output=True,
                           text=True, check=True).stdout
    assert "pytest" in found and found.startswith("python3 -m venv"), found


def test_what_the_docs_examples_import_comes_with_the_project():
    """A reader who installed the project (pip install -e ., no extras) can run the docs' Python:
    every module their code imports is a main dependency's (serving.md's OpenAI client)."""
    import importlib.metadata
    import tomllib

    pinned = {re.split(r"[=<>\[;]", d)[0].lower() for d in
              tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]}
    shipped = importlib.metadata.packages_distributions()
    code = re.compile(r"^ {4,}(?:from ([A-Za-z_]\w*)[\w.]* import [\w*(]|import ([A-Za-z_]\w*)[\w.]*\s*$)", re.M)
    imported = {a or b for page in PAGES for a, b in code.findall(page.read_text())}
    assert imported, "no example imports anything: the test tests nothing"
    missing = {m for m in imported if m != "stages" and not {d.lower() for d in shipped.get(m, [m])} & pinned}
    assert not missing, f"the docs import {sorted(missing)}, which pip install -e . does not install"
