"""README.md stays short and every relative link in README.md and docs/*.md resolves (issue 29).

A relative link must name a file or directory inside the repository; a ``page.md#anchor`` link
(or ``#anchor`` within the same page) must name a heading of that page under GitHub's anchor rule
(github-slugger: the heading's rendered text, lower-cased, every character that is not a letter,
digit, mark, ``_``, ``-`` or space dropped, each space turned into ``-``; a repeated slug gets
``-1``, ``-2``, ...). Links inside fenced code blocks and inline code are not links and are not
checked. External links (``https:``, ``mailto:`` ...) are not fetched.
"""
from __future__ import annotations

import re
import shutil
import unicodedata
from pathlib import Path
from urllib.parse import unquote

ROOT = Path(__file__).resolve().parents[1]
README_MAX_BYTES = 15_000

_FENCE = re.compile(r"^ {0,3}(`{3,}|~{3,})")
_INLINE_CODE = re.compile(r"(`+)(.+?)\1")
# [text](target "title") and ![alt](target); text may hold one level of nested brackets.
_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\[\]]*\])*\]\(\s*<?([^)\s>]*)>?(?:\s+\"[^\"]*\")?\s*\)")
_REF_DEF = re.compile(r"^ {0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+.*)?$")
_HEADING = re.compile(r"^ {0,3}(#{1,6})[ \t]+(.*?)(?:[ \t]+#+)?[ \t]*$")
_HTML_ANCHOR = re.compile(r"<a\s+(?:name|id)=\"([^\"]+)\"", re.IGNORECASE)
_EXTERNAL = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*:")


def _prose_lines(text: str):
    """Yield (line number, line) outside fenced code blocks, inline code spans blanked."""
    fence = None
    for n, line in enumerate(text.split("\n"), 1):
        m = _FENCE.match(line)
        if fence is None and m:
            fence = m.group(1)[0] * len(m.group(1))
            continue
        if fence is not None:
            if m and m.group(1).startswith(fence) and not line.strip()[len(m.group(1)):].strip():
                fence = None
            continue
        yield n, line


def github_slug(heading: str) -> str:
    """The anchor GitHub gives a heading whose markdown source is ``heading``."""
    text = _INLINE_CODE.sub(lambda m: m.group(2).strip(), heading)
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", text)      # links and images: their text
    text = re.sub(r"<[^>]+>", "", text)                          # inline HTML
    text = text.replace("*", "")                                 # emphasis markers
    text = text.strip().lower()
    kept = "".join(ch for ch in text if ch in "-_ " or unicodedata.category(ch)[0] in "LNM")
    return kept.replace(" ", "-")


def anchors(text: str) -> set[str]:
    """Every anchor a markdown page defines: heading slugs (with GitHub's -N suffixes) and <a id/name>."""
    seen: dict[str, int] = {}
    out: set[str] = set()
    for _, line in _prose_lines(text):
        m = _HEADING.match(line)
        if m:
            slug = github_slug(m.group(2))
            if slug in seen:
                seen[slug] += 1
                slug = f"{slug}-{seen[slug]}"
            else:
                seen[slug] = 0
            out.add(slug)
        out.update(_HTML_ANCHOR.findall(line))
    return out


def links(text: str):
    """Yield (line number, target) of every markdown link outside code."""
    for n, line in _prose_lines(text):
        prose = _INLINE_CODE.sub(lambda m: " " * len(m.group(0)), line)
        for m in _LINK.finditer(prose):
            yield n, m.group(1)
        m = _REF_DEF.match(prose)
        if m:
            yield n, m.group(1)


def check_links(md_file: Path, root: Path, text: str | None = None) -> list[str]:
    """Broken relative links of one markdown file, one message each ('file:line: target: why')."""
    text = md_file.read_text(encoding="utf-8") if text is None else text
    root = root.resolve()
    errors = []
    for n, target in links(text):
        where = f"{md_file.relative_to(root) if md_file.resolve().is_relative_to(root) else md_file}:{n}: {target!r}"
        if not target:
            errors.append(f"{where}: empty link target")
            continue
        if _EXTERNAL.match(target):
            continue
        path_part, _, anchor = target.partition("#")
        if path_part:
            base = root if path_part.startswith("/") else md_file.resolve().parent
            dest = (base / unquote(path_part.lstrip("/"))).resolve()
            if not dest.is_relative_to(root):
                errors.append(f"{where}: points outside the repository")
                continue
            if not dest.exists():
                errors.append(f"{where}: no such file {dest.relative_to(root)}")
                continue
        else:
            dest = md_file.resolve()
        if anchor and dest.suffix == ".md" and dest.is_file():
            dest_text = text if dest == md_file.resolve() else dest.read_text(encoding="utf-8")
            if unquote(anchor) not in anchors(dest_text):
                errors.append(f"{where}: no heading with anchor #{anchor} in {dest.name}")
    return errors


def _doc_files(root: Path) -> list[Path]:
    return [root / "README.md"] + sorted((root / "docs").glob("*.md"))


# ------------------------------------------------------------------------------------- the repo


def test_readme_fits_in_15_kb():
    size = (ROOT / "README.md").stat().st_size
    assert size <= README_MAX_BYTES, f"README.md is {size} bytes; move detail to docs/ (limit {README_MAX_BYTES})"


def test_every_relative_link_in_readme_and_docs_resolves():
    files = _doc_files(ROOT)
    assert len(files) > 2, "docs/*.md pages are missing"
    n_links = sum(1 for f in files for _ in links(f.read_text(encoding="utf-8")))
    assert n_links >= len(files), f"only {n_links} links found: the link scanner is broken"
    errors = [e for f in files for e in check_links(f, ROOT)]
    assert not errors, "broken links:\n" + "\n".join(errors)


def test_readme_links_every_docs_page():
    readme = ROOT / "README.md"
    linked = {
        (readme.parent / unquote(t.partition("#")[0])).resolve()
        for _, t in links(readme.read_text(encoding="utf-8"))
        if t and not _EXTERNAL.match(t) and t.partition("#")[0]
    }
    unlinked = [p.name for p in sorted((ROOT / "docs").glob("*.md")) if p.resolve() not in linked]
    assert not unlinked, f"README.md's documentation list does not link: {unlinked}"


# ---------------------------------------------------------------------------------- the checker


def test_github_slug_rule():
    assert github_slug("Draft vocabulary (FR-Spec / EAGLE-3 `d2t`)") == "draft-vocabulary-fr-spec--eagle-3-d2t"
    assert github_slug("W&B modes") == "wb-modes"
    assert github_slug("AdaDecode: three thresholds γ (issue 5)") == "adadecode-three-thresholds-γ-issue-5"
    assert github_slug("Cache → batch contract (`data_prep.cache`)") == "cache--batch-contract-data_prepcache"
    assert github_slug("EAGLE-3 against Falcon k = 1") == "eagle-3-against-falcon-k--1"
    assert github_slug("**Bold** and [a link](x.md)") == "bold-and-a-link"
    assert anchors("# A\n## A\n```\n# A\n```\n## A\n") == {"a", "a-1", "a-2"}


def _planted(tmp_path: Path) -> tuple[Path, Path]:
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "page.md").write_text("# Page\n\n## Sub section: one\n", encoding="utf-8")
    readme = tmp_path / "README.md"
    readme.write_text(
        "# Top\n"
        "[ok file](docs/page.md) [ok anchor](docs/page.md#sub-section-one) [ok self](#top)\n"
        "[ok dir](docs) [ok web](https://example.org/x.md#nope) ![ok image](docs/page.md)\n"
        "[missing](docs/missing.md)\n"
        "[bad anchor](docs/page.md#sub-section-two)\n"
        "[bad self](#nowhere)\n"
        "[outside](../elsewhere.md)\n"
        "`[in code](docs/missing.md)`\n"
        "```\n[in a fence](docs/missing.md)\n```\n"
        "[ref]: docs/missing-ref.md\n",
        encoding="utf-8",
    )
    return readme, tmp_path


def test_checker_reports_each_planted_break_and_nothing_else(tmp_path):
    readme, root = _planted(tmp_path)
    errors = check_links(readme, root)
    assert len(errors) == 5, errors
    assert "README.md:4: 'docs/missing.md': no such file docs/missing.md" in errors
    assert any(e.startswith("README.md:5:") and "#sub-section-two" in e for e in errors)
    assert any(e.startswith("README.md:6:") and "#nowhere" in e for e in errors)
    assert any(e.startswith("README.md:7:") and "outside the repository" in e for e in errors)
    assert any(e.startswith("README.md:12:") and "missing-ref.md" in e for e in errors)


def test_checker_fails_on_a_link_planted_in_the_real_docs(tmp_path):
    shutil.copy(ROOT / "README.md", tmp_path / "README.md")
    shutil.copytree(ROOT / "docs", tmp_path / "docs")
    # the docs also point at the shipped head's curve, outside docs/
    shutil.copytree(ROOT / "heads_of_record", tmp_path / "heads_of_record", ignore=shutil.ignore_patterns("*.safetensors"))
    assert [e for f in _doc_files(tmp_path) for e in check_links(f, tmp_path)] == []
    page = tmp_path / "docs" / "heads.md"
    page.write_text(page.read_text(encoding="utf-8") + "\nSee [the trees](trees.md#no-such-heading) and [x](nope.md).\n",
                    encoding="utf-8")
    errors = [e for f in _doc_files(tmp_path) for e in check_links(f, tmp_path)]
    assert len(errors) == 2, errors
    assert "#no-such-heading" in errors[0] and "nope.md" in errors[1]
