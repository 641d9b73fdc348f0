"""scripts/trust_check.py: the trust check pooled over runs, from hand-written calibration.jsonl files."""
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
import trust_check as TC  # noqa: E402


def _run(d: Path, rows):
    d.mkdir()
    (d / "calibration.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(d)


def test_pooled_over_runs_and_per_run(tmp_path, capsys):
    a = _run(tmp_path / "a", [{"step": 1, "task_id": "g1", "trust_eb": 0.9, "trust_raw": 0.6, "fresh_gain": 0.5},
                              {"step": 1, "task_id": "g2", "trust_eb": 0.7, "trust_raw": 0.8, "fresh_gain": -0.25}])
    b = _run(tmp_path / "b", [{"step": 1, "task_id": "g1", "trust_eb": 0.2, "trust_raw": 0.3, "fresh_gain": 0.0},
                              {"step": 2, "task_id": "g1", "trust_eb": 0.5, "trust_raw": 1.0, "fresh_gain": -0.5}])
    assert TC.main([a, b, "--out", str(tmp_path / "out")]) == 0
    res = json.loads((tmp_path / "out" / "trust_check.json").read_text())
    # pooled: y = 1, 0, 1/2, 0 -> eb Brier (0.01 + 0.49 + 0.09 + 0.25) / 4 = 0.21,
    # raw (0.16 + 0.64 + 0.04 + 1) / 4 = 0.46
    assert res["pooled"]["eb"]["brier"] == pytest.approx(0.21) and res["pooled"]["raw"]["brier"] == pytest.approx(0.46)
    # run a alone: eb (0.01 + 0.49) / 2 = 0.25; run b alone: raw (0.04 + 1.0) / 2 = 0.52
    assert (res["runs"][a]["eb"]["brier"] == pytest.approx(0.25)
            and res["runs"][b]["raw"]["brier"] == pytest.approx(0.52))
    assert (tmp_path / "out" / "trust_check.png").stat().st_size > 0
    assert "Brier 0.2100" in capsys.readouterr().out


def test_run_without_calibration_is_a_clear_error(tmp_path):
    (tmp_path / "r").mkdir()
    with pytest.raises(SystemExit, match="--calibrate"):
        TC.main([str(tmp_path / "r")])
