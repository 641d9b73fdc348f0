"""What only train.py, scripts/ and tests/ use: the CPU presets (cpu_preset.py), the run report
(report.py, also `python -m harness.report runs/<name>`)."""
