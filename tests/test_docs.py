"""Docs links: every relative link in README.md and docs/ resolves inside the repository, and so
does every `docs/<page>.md#anchor` cited in code."""
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
CODE = [p for d in ("rl_jax", "configs", "tests", "benchmarks") for p in sorted((ROOT / d).rglob("*.py"))]


def _slug(heading: str) -> str:
  """GitHub's anchor of a heading: lower case, punctuation dropped, spaces -> '-'."""
  return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(page: pathlib.Path) -> set[str]:
  text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)   # '#' in code is no heading
  heads = {_slug(m) for m in re.findall(r"^#+ (.+)$", text, flags=re.M)}
  return heads | set(re.findall(r'<a id="([^"]+)"', text))


def _links(page: pathlib.Path) -> list[str]:
  text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
  return [t for t in re.findall(r"\]\(([^)\s]+)\)", text) if not re.match(r"[a-z]+:", t)]


def test_slug_and_anchor_parsing():
  assert _slug("Composing with an IS weight") == "composing-with-an-is-weight"
  assert _slug("### naive_is".lstrip("# ")) == "naive_is"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_relative_links_resolve_inside_the_repository(page):
  for target in _links(page):
    path, _, anchor = target.partition("#")
    f = (page.parent / path).resolve() if path else page
    assert f.is_relative_to(ROOT), f"{page.name}: {target} points outside the repository"
    assert f.exists(), f"{page.name}: {target}: no such file"
    if anchor:
      assert f.suffix == ".md" and anchor in _anchors(f), f"{page.name}: {target}: no such anchor"


def test_code_cites_existing_doc_anchors():
  missing = [(p.relative_to(ROOT).as_posix(), doc, a) for p in CODE
             for doc, a in re.findall(r"docs/(\w+\.md)#([\w-]+)", p.read_text())
             if not (ROOT / "docs" / doc).exists() or a not in _anchors(ROOT / "docs" / doc)]
  assert not missing, missing
