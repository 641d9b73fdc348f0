"""METHOD.md §8's examples, each run as it stands: what a copier of rsipo.py, shrinkage.py and skills.py reads
must work."""
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def _examples() -> list[str]:
    text = (ROOT / "METHOD.md").read_text()
    section = text[text.index("## 8. Using rsipo.py, shrinkage.py and skills.py in TRL or verl"):]
    return re.findall(r"```python\n(.*?)```", section, re.DOTALL)


def test_there_are_examples_for_each_of_the_three_files():
    blocks = _examples()
    assert len(blocks) == 4
    for name in ("rsipo", "shrinkage", "skills"):
        assert any(f"import {name}" in b or f"from {name} import" in b for b in blocks), name


@pytest.mark.parametrize("k", range(4))
def test_each_example_runs(k):
    code = _examples()[k]
    assert "assert " in code                       # each example checks its own result
    exec(compile(code, f"METHOD.md example {k}", "exec"), {"__name__": f"example_{k}"})
