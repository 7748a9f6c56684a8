"""The README opens with the two set-up commands, and CI runs the second one verbatim."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_readme_commands_and_ci_agree():
    blocks = re.findall(r"```bash\n(.*?)\n```", (ROOT / "README.md").read_text(), re.S)
    run, test = blocks[0].strip(), blocks[1].strip()
    assert "ds4x generate" in run and "pip install" in run
    assert "pytest" in test
    assert test in (ROOT / ".ci" / "run").read_text()
