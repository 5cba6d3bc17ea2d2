"""Every relative link and every anchor in README.md and docs/ resolves.

A link names a file that exists; an anchor (`#fragment`, `page.md#fragment`) names a heading
of that page, slugged the way the site's generator slugs it (Python-Markdown's `toc`, which
mkdocs uses: lowercase, punctuation removed, spaces to hyphens) and the way GitHub slugs it,
so that the link works on the site and on GitHub alike; or an explicit `{#id}` or
`<a id=...>`. Web links (http, https, mailto) are not followed. Pure Python, no mkdocs.
"""

from __future__ import annotations

import html
import re
import unicodedata
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

FENCE = re.compile(r"^ {0,3}(```|~~~)")
CODE_SPAN = re.compile(r"(`+)(.+?)\1")
# [text](target "title") and ![alt](target); the text may hold one level of brackets.
INLINE_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
REFERENCE_DEF = re.compile(r"^ {0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+.*)?$")
HEADING = re.compile(r"^ {0,3}(#{1,6})\s+(.*?)\s*#*\s*$")
EXPLICIT_ID = re.compile(r"\{:?\s*#([\w-]+)[^}]*\}\s*$")
HTML_ID = re.compile(r"<a\s+[^>]*\b(?:id|name)\s*=\s*[\"']([^\"']+)[\"']", re.IGNORECASE)
EXTERNAL = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")  # http:, https:, mailto:, ...


def pages(root: Path = ROOT) -> list[Path]:
    return [root / "README.md", *sorted((root / "docs").rglob("*.md"))]


def outside_fences(text: str) -> Iterator[tuple[int, str]]:
    """(line number, line) of the lines outside fenced code blocks."""
    fence: str | None = None
    for number, line in enumerate(text.split("\n"), 1):
        match = FENCE.match(line)
        if match:
            if fence is None:
                fence = match.group(1)
            elif match.group(1) == fence:
                fence = None
            continue
        if fence is None:
            yield number, line


def prose_lines(text: str) -> Iterator[tuple[int, str]]:
    """The lines outside fenced code blocks, with code spans blanked."""
    for number, line in outside_fences(text):
        yield number, CODE_SPAN.sub(lambda m: " " * len(m.group(0)), line)


def heading_text(raw: str) -> str:
    """A heading's text as it renders: markup dropped, code spans kept as their content."""
    text = EXPLICIT_ID.sub("", raw)
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", text)  # links and images: their text
    text = CODE_SPAN.sub(lambda m: m.group(2).strip(), text)
    text = re.sub(r"<[^>]+>", "", text)  # inline HTML
    text = re.sub(r"(\*\*|__|\*)(.+?)\1", r"\2", text)  # emphasis
    return html.unescape(text)


def slug_toc(text: str) -> str:
    """Python-Markdown's toc slugify (markdown.extensions.toc.slugify), as mkdocs uses it."""
    value = unicodedata.normalize("NFKD", text).encode("ascii", "ignore").decode("ascii")
    value = re.sub(r"[^\w\s-]", "", value).strip().lower()
    return re.sub(r"[-\s]+", "-", value)


def slug_github(text: str) -> str:
    """GitHub's heading anchors: lowercase, punctuation dropped, each space a hyphen."""
    return re.sub(r"[^\w\- ]", "", text.strip().lower()).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """The anchors a page offers that both the site and GitHub resolve the same way."""
    toc_seen: dict[str, int] = {}
    github_seen: dict[str, int] = {}
    found: set[str] = set()
    for _, line in outside_fences(path.read_text(encoding="utf-8")):
        found.update(HTML_ID.findall(CODE_SPAN.sub("", line)))
        match = HEADING.match(line)
        if not match:
            continue
        raw = match.group(2)
        explicit = EXPLICIT_ID.search(raw)
        if explicit:
            found.add(explicit.group(1))
            continue
        text = heading_text(raw)
        toc = _unique(slug_toc(text), toc_seen, "_")
        github = _unique(slug_github(text), github_seen, "-")
        if toc == github:
            found.add(toc)
    return found


def _unique(slug: str, seen: dict[str, int], sep: str) -> str:
    count = seen.get(slug, 0)
    seen[slug] = count + 1
    return slug if count == 0 else f"{slug}{sep}{count}"


def links(path: Path) -> Iterator[tuple[int, str]]:
    for number, line in prose_lines(path.read_text(encoding="utf-8")):
        for match in INLINE_LINK.finditer(line):
            yield number, match.group(1)
        definition = REFERENCE_DEF.match(line)
        if definition:
            yield number, definition.group(1)


def broken_links(files: list[Path], root: Path = ROOT) -> list[str]:
    """'file:line: target: why' for every relative link or anchor that does not resolve."""
    cache: dict[Path, set[str]] = {}
    problems: list[str] = []
    for path in files:
        for number, target in links(path):
            if EXTERNAL.match(target) or target.startswith("//"):
                continue
            where = f"{path.relative_to(root)}:{number}: {target}"
            file_part, _, fragment = target.partition("#")
            resolved = (path.parent / file_part).resolve() if file_part else path
            if file_part and not resolved.exists():
                problems.append(f"{where}: no such file")
                continue
            if file_part and resolved.is_dir():
                if fragment:
                    problems.append(f"{where}: an anchor into a directory")
                continue
            if fragment:
                if resolved.suffix != ".md":
                    problems.append(f"{where}: an anchor into a file that is not Markdown")
                    continue
                if resolved not in cache:
                    cache[resolved] = anchors(resolved)
                if fragment not in cache[resolved]:
                    problems.append(f"{where}: no heading or id '{fragment}' in {resolved.name}")
    return problems


def test_every_relative_link_and_anchor_resolves() -> None:
    files = pages()
    assert (ROOT / "docs" / "index.md") in files
    problems = broken_links(files)
    assert not problems, "\n".join(problems)


def test_the_checker_finds_what_is_broken(tmp_path: Path) -> None:
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "page.md").write_text(
        "# A page\n\n## Kubernetes (`platform: kubernetes`)\n\n## Two | bars\n\n"
        "## Same\n\n## Same\n\n<a id=\"here\"></a>\n\n## Custom {#mine}\n",
        encoding="utf-8",
    )
    (tmp_path / "README.md").write_text(
        "[ok](docs/page.md) [ok](docs/page.md#kubernetes-platform-kubernetes)\n"
        "[differs](docs/page.md#same_1) is mkdocs' second 'Same' but GitHub's is same-1\n"
        "[ok](docs/page.md#here) [ok](docs/page.md#mine) [ok](#top-level) [web](https://x.invalid/a#b)\n"
        "# Top level\n"
        "[missing](docs/nowhere.md) [bad anchor](docs/page.md#kubernetes)\n"
        "[site only](docs/page.md#two-bars) ![gone](docs/gone.png)\n"
        "`[in code](docs/nowhere.md)`\n\n```\n[in a fence](docs/nowhere.md)\n```\n",
        encoding="utf-8",
    )
    problems = broken_links(pages(tmp_path), root=tmp_path)
    reported = sorted(p.split(": ", 2)[1] for p in problems)
    assert reported == [
        "docs/gone.png",
        "docs/nowhere.md",
        "docs/page.md#kubernetes",
        "docs/page.md#same_1",
        "docs/page.md#two-bars",
    ], problems


@pytest.mark.parametrize(
    ("heading", "slug"),
    [
        ("Over SSH (`platform: remote`)", "over-ssh-platform-remote"),
        ("Fleets of 10,000 agents (2026-11-24)", "fleets-of-10000-agents-2026-11-24"),
        ("Warm trial starts (`trialPreload`)", "warm-trial-starts-trialpreload"),
        ("**Bold** and [a link](x.md)", "bold-and-a-link"),
    ],
)
def test_headings_slug_as_the_site_does(heading: str, slug: str) -> None:
    assert slug_toc(heading_text(heading)) == slug
