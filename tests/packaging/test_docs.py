"""The README stays a user's manual (at most 400 lines, no dates or load averages: those
live in docs/benchmarks.md) that opens with the two set-up commands, and every relative
link of the README and docs/ resolves."""

from __future__ import annotations

import re
import subprocess
import sys

from tests.conftest import ROOT

README = ROOT / "README.md"


def test_readme_is_a_manual():
    text = README.read_text()
    assert len(text.splitlines()) <= 400
    assert re.findall(r"20\d\d-\d\d-\d\d", text) == []
    assert "load average" not in text.lower()
    assert "shared/DESIGN" not in text  # the design is docs/design.md, inside the repo


def test_readme_opens_with_the_two_setup_commands():
    block = README.read_text().split("```bash\n", 1)[1].split("```", 1)[0]
    assert block.splitlines() == [
        "bash scripts/setup.sh && .venv/bin/posttrain run recipes/quickstart_grpo.yaml",
        "bash scripts/setup.sh && .venv/bin/python -m pytest",
    ]


def test_every_relative_link_resolves():
    done = subprocess.run(
        [sys.executable, str(ROOT / "docs" / "check_links.py")], capture_output=True, text=True
    )
    assert done.returncode == 0, done.stdout + done.stderr
