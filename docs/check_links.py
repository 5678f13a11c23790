"""Check that every relative link in README.md and docs/*.md resolves.

A link `[text](path)` or `![alt](path)` that is not a URL must name an existing file or
folder, relative to the page that holds it; a `#fragment` must name a heading of the
target page, slugged as GitHub does (lowercase, punctuation but `-` and `_` dropped,
spaces to `-`, repeats numbered `-1`, `-2`, ...). Links inside code blocks are ignored.

Usage: python docs/check_links.py  (from anywhere; exits 1 and lists each broken link)
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```.*?^```", re.S | re.M)


def slugs(page: Path) -> set[str]:
    """GitHub's anchors of `page`'s headings."""
    seen: dict[str, int] = {}
    out = set()
    for line in FENCE.sub("", page.read_text()).splitlines():
        m = re.match(r"#{1,6}\s+(.*)", line)
        if not m:
            continue
        text = m.group(1).strip().lower().replace("`", "")
        slug = re.sub(r"[^\w\- ]", "", text).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def broken(page: Path) -> list[str]:
    """The links of `page` that do not resolve, each as 'page: link (why)'."""
    bad = []
    for target in LINK.findall(FENCE.sub("", page.read_text())):
        if re.match(r"[a-z]+:", target):
            continue  # a URL
        path, _, frag = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            bad.append(f"{page.relative_to(ROOT)}: {target} (no such file)")
        elif frag and dest.suffix == ".md" and frag not in slugs(dest):
            bad.append(f"{page.relative_to(ROOT)}: {target} (no such heading)")
    return bad


def main() -> int:
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    bad = [b for p in pages for b in broken(p)]
    count = sum(len(LINK.findall(FENCE.sub("", p.read_text()))) for p in pages)
    for b in bad:
        print(b)
    print(f"{count} links in {len(pages)} pages, {len(bad)} broken")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
