"""Files written whole or not at all, and JSONL read line by line.

A run can be killed at any point (a scheduler's SIGKILL, a full disk): every file and folder the
project writes for later reading goes to a temporary name beside its destination and is renamed into
place (`os.replace`, atomic on one filesystem), so a reader sees the old version or the new one, never
half of one. Checkpoints (infra/distributed.py) and the skill bank (skills.py, which imports nothing
from the project) do the same in their own code.
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path


def write_text(path, text: str) -> Path:
    """Write `text` to `path` atomically (a temporary file in the same folder, then a rename)."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}-", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise
    return path


def write_json(path, obj, indent: int = 1) -> Path:
    """`obj` as JSON at `path`, atomically."""
    return write_text(path, json.dumps(obj, indent=indent))


def write_folder(dest, write) -> Path:
    """Call write(tmp) on a fresh temporary folder beside `dest`, then rename it to `dest`. When another
    process renamed its own copy into place first, that copy is kept and this one removed."""
    dest = Path(dest)
    tmp = dest.with_name(f"{dest.name}.tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    write(tmp)
    try:
        os.replace(tmp, dest)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
    return dest


def jsonl_lines(path) -> list[tuple[int, object]]:
    """(line number, parsed value) for each non-blank line of a JSONL file; a line that is not JSON
    gives its `ValueError` as the value, so that each caller decides: refuse the file with the line
    number (data files), or skip and count the line (a run's own logs, which a crash can cut)."""
    out = []
    with open(path, encoding="utf-8", errors="replace") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                out.append((n, json.loads(line)))
            except ValueError as e:
                out.append((n, e))
    return out
