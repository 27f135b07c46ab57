"""The docs hold together: every page under docs/ is in mkdocs.yml's nav and every nav entry exists,
every relative link in the Markdown files resolves (to a file, and to a heading when it names an
anchor, by GitHub's and MkDocs' slug rules both), every test file named in code (`tests/….py`, with
`::test_name` when given) exists, and the README stays a front page. No Spark, no Postgres: plain file reads."""

from __future__ import annotations

import re
import unicodedata
from pathlib import Path
from typing import Any, Iterator

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
README_MAX_LINES = 250

FENCE = re.compile(r"^(```|~~~)")
INLINE_CODE = re.compile(r"`[^`]*`")
INLINE_LINK = re.compile(r"!?\[((?:[^\[\]]|\[[^\]]*\])*)\]\(\s*<?([^)\s>]*)>?(?:\s+\"[^\"]*\")?\s*\)")
REFERENCE_LINK = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+\"[^\"]*\")?\s*$")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
TEST_PATH = re.compile(r"`(tests/[\w/]+\.py)(?:::(\w+))?")
EXTERNAL = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")  # http:, https:, mailto:, …


def markdown_files() -> list[Path]:
    """The Markdown files whose links must resolve: the README, the changelog, dags/ and docs/."""
    files = [ROOT / "README.md", ROOT / "CHANGELOG.md", ROOT / "dags" / "README.md"]
    return [f for f in files if f.exists()] + sorted(DOCS.rglob("*.md"))


def prose_lines(text: str) -> Iterator[tuple[int, str]]:
    """(line number, line) outside fenced code blocks."""
    fenced = False
    for number, line in enumerate(text.splitlines(), 1):
        if FENCE.match(line.lstrip()):
            fenced = not fenced
            continue
        if not fenced:
            yield number, line


def heading_text(raw: str) -> str:
    """A heading's text as rendered: code spans and links reduced to their text, emphasis dropped."""
    text = INLINE_LINK.sub(lambda m: m.group(1), raw)
    text = text.replace("`", "")
    return re.sub(r"(\*\*|\*)", "", text)


def github_slug(text: str) -> str:
    """GitHub's anchor for a heading (github-slugger): lower case, punctuation dropped, each space a '-'."""
    kept = "".join(ch for ch in text.lower() if ch in " -_" or unicodedata.category(ch)[0] in ("L", "N", "M"))
    return kept.replace(" ", "-")


def mkdocs_slug(text: str) -> str:
    """MkDocs' anchor for a heading (Python-Markdown's toc.slugify)."""
    value = unicodedata.normalize("NFKD", text).encode("ascii", "ignore").decode("ascii")
    value = re.sub(r"[^\w\s-]", "", value).strip().lower()
    return re.sub(r"[-\s]+", "-", value)


def anchors(path: Path) -> tuple[set[str], set[str]]:
    """The heading anchors of a Markdown file: (GitHub's, MkDocs'), duplicates numbered as each does."""
    github: dict[str, int] = {}
    mkdocs: dict[str, int] = {}
    github_out: set[str] = set()
    mkdocs_out: set[str] = set()
    for _, line in prose_lines(path.read_text()):
        match = HEADING.match(line)
        if not match:
            continue
        text = heading_text(match.group(2))
        for slug, seen, out, sep in (
            (github_slug(text), github, github_out, "-"),
            (mkdocs_slug(text), mkdocs, mkdocs_out, "_"),
        ):
            count = seen.get(slug, 0)
            seen[slug] = count + 1
            out.add(slug if count == 0 else f"{slug}{sep}{count}")
    return github_out, mkdocs_out


def relative_links(path: Path) -> Iterator[tuple[int, str]]:
    """(line number, target) of every relative link in a Markdown file, outside code."""
    for number, line in prose_lines(path.read_text()):
        reference = REFERENCE_LINK.match(line)
        targets = [reference.group(1)] if reference else []
        targets += [m.group(2) for m in INLINE_LINK.finditer(INLINE_CODE.sub("", line))]
        for target in targets:
            if target and not EXTERNAL.match(target):
                yield number, target


def nav_pages(entries: Any) -> Iterator[str]:
    """Every page named in an mkdocs nav (strings, {title: page} and nested sections)."""
    if isinstance(entries, str):
        if not EXTERNAL.match(entries):
            yield entries
    elif isinstance(entries, list):
        for entry in entries:
            yield from nav_pages(entry)
    elif isinstance(entries, dict):
        for value in entries.values():
            yield from nav_pages(value)


def test_every_docs_page_is_in_the_mkdocs_nav_and_every_nav_entry_exists() -> None:
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text())
    assert config.get("docs_dir", "docs") == "docs"
    listed = list(nav_pages(config["nav"]))
    assert len(listed) == len(set(listed)), f"pages listed twice in mkdocs.yml: {sorted(listed)}"
    pages = {p.relative_to(DOCS).as_posix() for p in DOCS.rglob("*.md")}
    assert not sorted(set(listed) - pages), f"mkdocs.yml lists pages that do not exist: {sorted(set(listed) - pages)}"
    assert not sorted(pages - set(listed)), f"pages missing from mkdocs.yml's nav: {sorted(pages - set(listed))}"


@pytest.mark.parametrize("path", markdown_files(), ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_relative_link_points_to_an_existing_file_and_heading(path: Path) -> None:
    broken = []
    for number, target in relative_links(path):
        file_part, _, anchor = target.partition("#")
        destination = (path.parent / file_part).resolve() if file_part else path
        where = f"{path.relative_to(ROOT)}:{number}: {target}"
        if not destination.exists():
            broken.append(f"{where}: no such file")
            continue
        if path.is_relative_to(DOCS) and not destination.is_relative_to(DOCS):
            broken.append(f"{where}: outside docs/ (the MkDocs site cannot serve it)")
            continue
        if anchor and destination.suffix == ".md":
            github, mkdocs = anchors(destination)
            if anchor not in github or anchor not in mkdocs:
                broken.append(
                    f"{where}: no heading with that anchor on GitHub and on MkDocs (GitHub's: {sorted(github)})"
                )
    assert not broken, "broken links:\n" + "\n".join(broken)


@pytest.mark.parametrize("path", markdown_files(), ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_test_file_named_exists_with_the_test_named(path: Path) -> None:
    missing = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        for file, test in TEST_PATH.findall(line):
            where = f"{path.relative_to(ROOT)}:{number}: {file}"
            if not (ROOT / file).is_file():
                missing.append(f"{where}: no such file")
            elif test and not re.search(rf"^def {test}\(", (ROOT / file).read_text(), re.M):
                missing.append(f"{where}: no test {test}")
    assert not missing, "test files named that do not exist:\n" + "\n".join(missing)


def test_the_readme_is_a_front_page() -> None:
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= README_MAX_LINES, (
        f"README.md has {len(lines)} lines (at most {README_MAX_LINES}): reference goes in docs/, history "
        "in CHANGELOG.md"
    )


@pytest.mark.parametrize(
    "heading, github, mkdocs",
    [
        ("Configure: `sequin.yaml`", "configure-sequinyaml", "configure-sequinyaml"),
        ("The pull API's store side", "the-pull-apis-store-side", "the-pull-apis-store-side"),
        (
            "`idle_replication_slot_timeout` (18)",
            "idle_replication_slot_timeout-18",
            "idle_replication_slot_timeout-18",
        ),
        ("A & B", "a--b", "a-b"),
        ("Trying it: `make up` and the demo", "trying-it-make-up-and-the-demo", "trying-it-make-up-and-the-demo"),
    ],
)
def test_slugs_follow_github_and_mkdocs(heading: str, github: str, mkdocs: str) -> None:
    text = heading_text(heading)
    assert (github_slug(text), mkdocs_slug(text)) == (github, mkdocs)
