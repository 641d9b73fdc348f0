"""harness/config.py: the presets (named, chosen by flags, never by a path), their merge order, the flags a
command line gives winning, what `--help` shows, and where each changed default came from."""
import dataclasses
import shutil
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from harness import config, tiny  # noqa: E402


def test_the_default_run_is_the_heldout_preset_and_preset_none_keeps_the_tiny_one(monkeypatch):
    monkeypatch.chdir(ROOT)
    d = config.parse_args([])
    assert (d.preset, d.data_root, d.sft_hold_out, d.sft_hold_out_mode, d.sft_rl_games, d.constrained,
            d.max_env_steps, d.alpha) == ("heldout", "data/alfworld_clean", "clean", "teacher", False, False, 8000, 0.1)
    assert d.sft_walkthroughs == "data/alfworld,data/alfworld_sft" and d.lr == 5e-5   # the tiny preset under it
    assert config.parse_args(["--constrained", "true"]).constrained is True            # a flag given wins
    for other in (["--preset", "none"], ["--model", "org/x"], ["--env", "search"]):
        a = config.parse_args(other)
        assert (a.sft_hold_out, a.max_env_steps, a.sft_rl_games, a.alpha) == ("", 0, True, 0.01), other
    assert config.parse_args(["--preset", "none"]).constrained is True                 # the tiny preset's
    with pytest.raises(SystemExit, match="--preset"):
        config.parse_args(["--preset", "clean"])
    with pytest.raises(SystemExit, match="--constrained"):
        config.parse_args(["--env", "search", "--constrained", "true"])


def test_no_preset_depends_on_where_the_data_lies(tmp_path, monkeypatch):
    """A copy of the default data elsewhere, and the all-types data, run the default run's settings."""
    monkeypatch.chdir(ROOT)
    copy = tmp_path / "elsewhere"
    shutil.copytree(ROOT / "data" / "alfworld_clean" / "json_2.1.1" / "train", copy / "json_2.1.1" / "train")
    default = dataclasses.asdict(config.parse_args([]))
    for root in (str(copy), "data/alfworld"):
        moved = dataclasses.asdict(config.parse_args(["--data_root", root]))
        assert {k: v for k, v in moved.items() if v != default[k]} == {"data_root": root}


def test_a_tiny_checkpoint_takes_the_rl_part_of_the_default_run(tmp_path):
    tiny.train_tiny_tokenizer(["go to desk 1"]).save_pretrained(tmp_path)   # what is_tiny reads
    c = config.parse_args(["--model", str(tmp_path)])
    assert (c.sft_hold_out, c.sft_rl_games, c.constrained, c.max_env_steps, c.alpha, c.lr) == \
        ("", True, False, 8000, 0.1, 5e-5)
    assert [n for n, _ in config.presets_for(dataclasses.asdict(c), gpu=False)] == ["tiny", "heldout"]


def test_presets_merge_in_order_and_name_themselves():
    flags = {"model": "tiny", "env": "search", "algo": "gigpo", "preset": "heldout"}
    assert [n for n, _ in config.presets_for(flags, gpu=True)] == ["tiny", "search", "gigpo"]   # no heldout: search
    merged = config.preset_values(flags, gpu=True)
    assert merged["constrained"] == (False, "search") and merged["lr"] == (5e-5, "tiny")        # search wins over tiny
    assert merged["step_adv"] == (1.0, "gigpo")
    real = {"model": "Qwen/Qwen2.5-7B-Instruct", "env": "alfworld", "algo": "rsipo", "preset": "heldout"}
    assert [n for n, _ in config.presets_for(real, gpu=True)] == ["gpu"]                        # heldout is
                                                                                                # the tiny run's
    assert config.presets_for(real, gpu=False) == []
    assert list(config.PRESETS) == ["tiny", "gpu", "heldout", "search", "gigpo"]
    assert all(isinstance(why, str) and why and "\n" not in why for why, _ in config.PRESETS.values())


def test_changed_defaults_name_their_source(monkeypatch):
    monkeypatch.chdir(ROOT)
    got = config.changed_defaults(config.parse_args(["--lr", "3e-5", "--seed", "2"]), gpu=False)
    assert "--lr 3e-05 (command line; default 1e-06)" in got
    assert "--seed 2 (command line; default 0)" in got
    assert "--alpha 0.1 (preset heldout; default 0.01)" in got
    assert "--c_kl 0.05 (preset tiny; default 0.01)" in got
    assert not any(c.startswith("--algo ") for c in got)                     # at its default: not listed
    assert config.changed_defaults(config.Args(), gpu=False) == []
    assert not any(c.startswith("--cache_dir") for c in got)                 # ~ expanded is still the default


def test_help_shows_each_presets_values_and_purpose(capsys):
    with pytest.raises(SystemExit):
        config.parse_args(["--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "[default 0.01; heldout: 0.1]" in out                               # --alpha
    assert "[default 1e-06; tiny: 5e-05]" in out and "[default 1.0; tiny: 0.3]" in out
    assert "[default 0.0; gigpo: 1.0]" in out                                 # --step_adv
    assert "heldout: the default run" in out
