"""What only train.py, scripts/ and tests/ use: the flags and presets (config.py), a run's set-up, resume,
checkpoints and end (run.py), the warm start's SFT (sft.py), the trust check (calibration.py), vLLM (vllm_engine.py),
the tiny model and its data (tiny.py), the run report (report.py, also `python -m harness.report runs/<name>`)."""
