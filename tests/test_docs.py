"""The README is a door: at most 15,000 bytes, and every relative link in it and in ``docs/`` leads somewhere.

A link ``[text](path#anchor)`` must name an existing file or folder inside the repository; with an anchor into a
Markdown file, that file must have a heading whose GitHub anchor is ``anchor``. External links (http, https, mailto)
are not followed. Links inside code blocks and inline code are not links.
"""

from __future__ import annotations

import re
import unicodedata
from pathlib import Path
from urllib.parse import unquote

REPO = Path(__file__).resolve().parent.parent
README_LIMIT = 15_000  # bytes, as `wc -c` counts them

FENCE = re.compile(r"^\s*(```|~~~)")
INLINE_CODE = re.compile(r"(`+)(?:(?!\1).)+?\1")
# [text](target) and ![alt](target); the target may be <...> and may carry a "title"
INLINE_LINK = re.compile(
    r"!?\[(?:[^\[\]]|\[[^\[\]]*\])*\]"  # [text], one level of nested brackets
    r"\(\s*(<[^>]*>|[^\s()]*(?:\([^\s()]*\)[^\s()]*)*)"  # (target, balanced parentheses allowed
    r"(?:\s+[\"'(][^)]*)?\s*\)"  # "title")
)
REFERENCE_DEF = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*(<[^>]*>|\S+)")
EXTERNAL = re.compile(r"^(https?:|mailto:)", re.IGNORECASE)
SCHEME = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")


def doc_files() -> list[Path]:
    return [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]


def prose_lines(text: str, blank_code: bool = True):
    """(line number, line) outside fenced code blocks, with inline code spans blanked (unless ``blank_code`` is
    false: a heading's anchor keeps the text inside backticks)."""
    fence = None
    for number, line in enumerate(text.splitlines(), 1):
        m = FENCE.match(line)
        if m:
            if fence is None:
                fence = m.group(1)
            elif m.group(1) == fence:
                fence = None
            continue
        if fence is None:
            yield number, INLINE_CODE.sub(lambda c: " " * len(c.group(0)), line) if blank_code else line


def links(text: str) -> list[tuple[int, str]]:
    """(line number, target) of every inline link, image and reference definition."""
    found = []
    for number, line in prose_lines(text):
        found += [(number, m.group(1)) for m in INLINE_LINK.finditer(line)]
        m = REFERENCE_DEF.match(line)
        if m:
            found.append((number, m.group(1)))
    return [(n, t[1:-1] if t.startswith("<") and t.endswith(">") else t) for n, t in found]


def github_anchor(heading: str) -> str:
    """The anchor GitHub gives a heading: its rendered text, lower-cased, without punctuation, spaces as hyphens."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # links and images: their text
    text = re.sub(r"<[^>]+>", "", text)  # inline HTML
    text = text.replace("`", "").lower()
    kept = [c for c in text if c in " -_" or unicodedata.category(c)[0] in "LNM"]
    return "".join(kept).replace(" ", "-")


def anchors(text: str) -> set[str]:
    """Every heading's anchor; repeated headings get -1, -2, ... as on GitHub."""
    seen: dict[str, int] = {}
    result = set()
    for _, line in prose_lines(text, blank_code=False):
        m = re.match(r"^\s{0,3}#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not m:
            continue
        slug = github_anchor(m.group(1).strip())
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        result.add(slug if count == 0 else f"{slug}-{count}")
    return result


def broken_links(path: Path, root: Path = REPO) -> list[str]:
    """What is wrong with each relative link of ``path`` (empty when every link resolves)."""
    text = path.read_text(encoding="utf-8")
    problems = []
    for number, target in links(text):
        if not target or EXTERNAL.match(target):
            continue
        where = f"{path.relative_to(root)}:{number}: {target}"
        if SCHEME.match(target):
            problems.append(f"{where}: a scheme other than http(s)/mailto")
            continue
        file_part, _, anchor = target.partition("#")
        file_part = unquote(file_part.split("?", 1)[0])
        resolved = (path.parent / file_part).resolve() if file_part else path.resolve()
        if not resolved.is_relative_to(root.resolve()):
            problems.append(f"{where}: outside the repository")
            continue
        if not resolved.exists():
            problems.append(f"{where}: no such file")
            continue
        is_markdown = resolved.suffix.lower() == ".md"
        if anchor and is_markdown and unquote(anchor) not in anchors(resolved.read_text(encoding="utf-8")):
            problems.append(f"{where}: no heading with anchor #{anchor} in {resolved.relative_to(root.resolve())}")
    return problems


def test_docs_links_resolve():
    problems = [p for path in doc_files() for p in broken_links(path)]
    assert not problems, "broken links:\n" + "\n".join(problems)


def test_docs_readme_is_at_most_15000_bytes():
    size = len((REPO / "README.md").read_bytes())
    assert size <= README_LIMIT, f"README.md is {size} bytes: move reference material to docs/ (limit {README_LIMIT})"


def test_docs_every_page_is_linked_from_the_readme():
    readme = REPO / "README.md"
    linked = {
        (readme.parent / unquote(t.partition("#")[0])).resolve()
        for _, t in links(readme.read_text(encoding="utf-8"))
        if t and not SCHEME.match(t) and t.partition("#")[0]
    }
    pages = sorted((REPO / "docs").rglob("*.md"))
    assert pages, "docs/ has no pages"
    missing = [str(p.relative_to(REPO)) for p in pages if p.resolve() not in linked]
    assert not missing, f"docs pages the README's Documentation list does not link: {missing}"


# The checker itself, on files made for it.


def test_docs_github_anchor():
    assert github_anchor("Settings frozen at `train()` start") == "settings-frozen-at-train-start"
    assert github_anchor("Privacy unit: examples or users, and adaptive clipping") == (
        "privacy-unit-examples-or-users-and-adaptive-clipping"
    )
    assert github_anchor("TRL: preference optimization (DPO)") == "trl-preference-optimization-dpo"
    assert github_anchor("Supervised fine-tuning (SFT)") == "supervised-fine-tuning-sft"
    assert github_anchor("Several GPUs or nodes, and large models") == "several-gpus-or-nodes-and-large-models"
    assert github_anchor("[FSDP2](x.md) on `fully_shard`") == "fsdp2-on-fully_shard"
    assert anchors("# A\n## A\n```\n# not a heading\n```\n## B-c\n") == {"a", "a-1", "b-c"}


def test_docs_link_checker_finds_broken_links(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "page.md").write_text("# Page\n\n## Two words\n", encoding="utf-8")
    (tmp_path / "code.py").write_text("", encoding="utf-8")
    readme = tmp_path / "README.md"
    readme.write_text(
        "\n".join(
            [
                "# Title",
                "[ok](docs/page.md) [ok anchor](docs/page.md#two-words) [self](#title) [code](code.py#L1)",
                "[web](https://example.com/missing.md) [mail](mailto:someone@example.com) ![img](<docs/page.md>)",
                "`[in code](missing-in-code.md)`",
                "```",
                "[in a fence](missing-in-fence.md)",
                "```",
                "[missing](docs/missing.md)",
                "[bad anchor](docs/page.md#three-words)",
                "[bad self anchor](#nowhere)",
                "[escape](../outside.md)",
                "[ref]: docs/also-missing.md",
            ]
        ),
        encoding="utf-8",
    )
    problems = broken_links(readme, root=tmp_path)
    assert len(problems) == 5, problems
    for line, target in [
        (8, "docs/missing.md"),
        (9, "docs/page.md#three-words"),
        (10, "#nowhere"),
        (11, "../outside.md"),
        (12, "docs/also-missing.md"),
    ]:
        assert any(p.startswith(f"README.md:{line}: {target}:") for p in problems), (line, problems)


def test_docs_link_checker_passes_a_clean_file(tmp_path):
    (tmp_path / "a.md").write_text("# A b\n\n[here](#a-b) [there](b.md#c) [web](http://x)\n", encoding="utf-8")
    (tmp_path / "b.md").write_text("# C\n", encoding="utf-8")
    assert broken_links(tmp_path / "a.md", root=tmp_path) == []
