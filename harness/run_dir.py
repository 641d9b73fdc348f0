"""[ours] A run folder that nothing can silently overwrite or share. `harness.run.setup` calls these on rank 0
before any compute, and every rank stops on rank 0's verdict:

* `claim`: a lock file (<run>/.lock: host, process id and the process's start time, read from Linux's /proc)
  keeps a second run out of a folder in use, with an error naming the process that holds it; a lock whose process
  is gone (killed, crashed) is taken over, and so is one this process took before. `release` removes it at the
  end of the run.
* `changed_flags`: a resume whose flags differ from those its checkpoint was written with, other than the ones
  `config.RESUME_MAY_CHANGE` lists (the budget, how often to evaluate and save, memory knobs, where the folder
  lies), is refused with every difference named: one run never mixes two configurations, and a changed learning
  rate is refused rather than silently overridden by the optimizer's saved one.
* `holds_a_run`: what `--resume false` would overwrite (a checkpoint, a warm start, a final policy, metrics); the
  run is refused unless `--overwrite true`, which clears the folder first (`clear`).
* `cut_rows`: on resume, metrics.jsonl keeps only the rows of the steps the checkpoint holds (a kill after a
  step's row and before its checkpoint would otherwise leave that step twice).

Test: pytest tests/test_run_dir.py
"""
from __future__ import annotations

import json
import os
import shutil
import socket
from pathlib import Path
from typing import Optional

LOCK = ".lock"
RUN_FILES = ("ckpt", "warm_start", "final", "metrics.jsonl", "sft")   # what a run leaves in its folder


def _started(pid: int) -> Optional[str]:
    """A process's start time (field 22 of /proc/<pid>/stat), or None when no such process runs here: a pid that
    the system gave to another process since has another start time."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def claim(run_dir: Path) -> Optional[str]:
    """Take the folder's lock for this process; None when taken, else why not (the holder, and what to do)."""
    lock = run_dir / LOCK
    me = {"host": socket.gethostname(), "pid": os.getpid(), "started": _started(os.getpid())}
    for _ in range(2):                    # a stale lock is removed once, then taken like a free one
        try:
            fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            try:
                held = json.loads(lock.read_text())
            except (OSError, ValueError):
                held = {}
            pid, here = int(held.get("pid", -1)), held.get("host") == me["host"]
            # alive: on another host (no way to tell: assumed), or here with the same start time (a pid the
            # system has given to another process since has another); this process's own (an earlier run) is its
            alive = not here or (_started(pid) or "gone") == held.get("started")
            if held and alive and not (here and pid == me["pid"]):
                return (f"error: {run_dir} is in use by process {held.get('pid')} on {held.get('host')} ({lock}): "
                        "two runs in one folder would write over each other's checkpoints and metrics. Use another "
                        f"--run_name, or, if no run uses the folder (a host that went away), delete {lock}")
            lock.unlink(missing_ok=True)  # the process that held it is gone (or is this one): take it over
            continue
        with os.fdopen(fd, "w") as f:
            json.dump(me, f)
        return None
    return f"error: {lock} could not be taken over"


def release(run_dir: Path):
    """Remove this process's lock (not another's)."""
    lock = run_dir / LOCK
    try:
        if json.loads(lock.read_text()).get("pid") == os.getpid():
            lock.unlink()
    except (OSError, ValueError):
        pass


def changed_flags(saved: dict, args, may_change) -> list[str]:
    """The flags of `args` whose value differs from the checkpoint's saved ones (args.json), as "--flag saved → now",
    leaving out `may_change` and the flags the checkpoint's code did not have."""
    now = vars(args)
    return [f"--{k} {saved[k]} → {now[k]}" for k in sorted(saved) if k in now and k not in may_change
            and saved[k] != now[k]]


def holds_a_run(run_dir: Path) -> list[str]:
    """What of a run the folder holds (checkpoints, warm start, final policy, metrics, an SFT's state)."""
    return [name for name in RUN_FILES if (run_dir / name).exists() or (run_dir / name).is_symlink()]


def clear(run_dir: Path):
    """Remove everything in the folder but the lock: --overwrite starts the run over in it."""
    for p in run_dir.iterdir():
        if p.name == LOCK:
            continue
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p)
        else:
            p.unlink()


def cut_rows(path: Path, step: int) -> list[dict]:
    """Keep the rows of metrics.jsonl up to `step` (the checkpoint's): the file is rewritten atomically; returns the
    rows kept. A line that does not parse (a kill mid-write) is dropped."""
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if isinstance(row, dict) and row.get("step", 0) <= step:
            rows.append(row)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in rows))
    os.replace(tmp, path)
    return rows
