"""The documentation stays usable: the README is short and starts with the quick start that CI
runs, every relative link in README.md and docs/ resolves to a file of the tree, every setting
mlfabric reads (mlfabric/_core/config.py) is documented in docs/, and the pages describe the
product, not how it is developed. One process, no MPI, a fraction of a second."""
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent.parent
README = ROOT / "README.md"
DOCS = ROOT / "docs"
PAGES = [README, *sorted(DOCS.rglob("*.md"))]

_FENCE = re.compile(r"^(```|~~~).*?^\1", re.S | re.M)
_CODE = re.compile(r"`[^`\n]*`")
_LINK = re.compile(r"\[[^\]\n]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")


def links(path):
    """The link targets of a Markdown page, outside code blocks and code spans."""
    text = _CODE.sub("", _FENCE.sub("", path.read_text(encoding="utf-8")))
    return _LINK.findall(text)


def relative(target):
    """The file part of a relative link, or None for a URL or an anchor in the same page."""
    if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I) or target.startswith(("#", "/")):
        return None
    return target.split("#", 1)[0] or None


def slugs(path):
    """GitHub's anchors of a Markdown page's headings: lower case, punctuation dropped, spaces
    to hyphens."""
    text = _FENCE.sub("", path.read_text(encoding="utf-8"))
    out = set()
    for title in re.findall(r"^#{1,6}\s+(.+?)\s*#*$", text, re.M):
        out.add(re.sub(r"[^\w\- ]", "", title.strip().lower()).replace(" ", "-"))
    return out


def test_readme_is_short():
    lines = README.read_text(encoding="utf-8").splitlines()
    assert len(lines) <= 200, f"README.md has {len(lines)} lines; move detail into docs/"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page):
    broken = [t for t in links(page) if relative(t) is not None
              and not (page.parent / relative(t)).exists()]
    assert not broken, f"{page.relative_to(ROOT)}: links to missing files: {broken}"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_anchors_resolve(page):
    broken = []
    for t in links(page):
        if "#" not in t or re.match(r"^[a-z][a-z0-9+.-]*:", t, re.I):
            continue
        file, anchor = t.split("#", 1)
        target = page if not file else page.parent / file
        if target.suffix == ".md" and target.exists() and anchor not in slugs(target):
            broken.append(t)
    assert not broken, f"{page.relative_to(ROOT)}: links to missing headings: {broken}"


def test_link_finder_sees_links():
    # guards the test above against a pattern that finds nothing
    assert any(relative(t) for t in links(README))
    assert len([t for p in PAGES for t in links(p) if relative(t)]) > 20


def test_every_setting_is_documented():
    config = (ROOT / "mlfabric" / "_core" / "config.py").read_text(encoding="utf-8")
    read = set(re.findall(r"MLFABRIC_[A-Z0-9_]+", config))
    assert read, "no MLFABRIC_* setting found in mlfabric/_core/config.py"
    docs = "\n".join(p.read_text(encoding="utf-8") for p in DOCS.rglob("*.md"))
    missing = sorted(v for v in read if not re.search(re.escape(v) + r"(?![A-Z0-9_])", docs))
    assert not missing, f"settings read by mlfabric/_core/config.py but not in docs/: {missing}"


def _block_after(text, heading):
    """The first fenced code block after a Markdown heading."""
    rest = text[text.index(heading):]
    block = re.search(r"```[a-z]*\n(.*?)```", rest, re.S)
    return block.group(1)


def test_quick_start_is_what_ci_runs():
    quick = _block_after(README.read_text(encoding="utf-8"), "## Quick start").splitlines()
    assert len(quick) == 2, "the quick start is two commands"
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    install, test = quick
    pip = install.split(" && ")[0]
    assert pip.startswith("pip install ")
    # .ci/run installs quietly through the venv's python: the same install otherwise
    assert "python -m " + pip.replace("pip install ", "pip install -q ") in ci
    assert re.search(r"^" + re.escape(test) + r"$", ci, re.M)


WORDS = re.compile(r"\b(sessions?|we tried|attempt(s|ed)?)\b", re.I)


@pytest.mark.parametrize("page", PAGES + [ROOT / "CHANGES.md"],
                         ids=lambda p: str(p.relative_to(ROOT)))
def test_pages_describe_the_product(page):
    hits = [f"{n}: {line.strip()}" for n, line in
            enumerate(page.read_text(encoding="utf-8").splitlines(), 1) if WORDS.search(line)]
    assert not hits, f"{page.relative_to(ROOT)} describes how it was developed: {hits}"
