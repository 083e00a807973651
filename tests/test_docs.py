"""The front door stays short and its links resolve: README.md at most ~200 lines with the one-GPU commands in its
first 150, and every relative link in README.md and docs/*.md pointing at a file of this repository."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = [README, *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\]\(([^)\s]+)\)")
FENCE = re.compile(r"```.*?```", re.S)


def relative_links(doc: Path) -> list[str]:
    text = FENCE.sub("", doc.read_text())
    return [target for target in LINK.findall(text) if not re.match(r"[a-z]+:", target) and not target.startswith("#")]


def test_the_readme_is_short_and_shows_the_one_gpu_commands_early():
    lines = README.read_text().splitlines()
    assert len(lines) <= 200, f"README.md has {len(lines)} lines; move detail to docs/"
    head = "\n".join(lines[:150])
    assert "setup --colocate" in head and "recipes/qwen2.5-3b_lora_colocate.yaml" in head
    for section in ("## Install", "## Quickstart", "## Usage in Python", "## One GPU", "## Results"):
        assert section in head, f"{section!r} is not within README.md's first 150 lines"


@pytest.mark.parametrize("doc", DOCS, ids=lambda doc: doc.name)
def test_every_relative_link_resolves(doc):
    missing = [target for target in relative_links(doc) if not (doc.parent / target.split("#")[0]).exists()]
    assert not missing, f"{doc.relative_to(ROOT)} links to missing files: {missing}"


def test_link_extraction_skips_code_urls_and_anchors(tmp_path):
    doc = tmp_path / "page.md"
    doc.write_text("[a](other.md#x) [b](https://x.org) [c](#local)\n```\n[d](inside_code.md)\n```\n")
    assert relative_links(doc) == ["other.md#x"]
