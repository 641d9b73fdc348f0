"""The hosts of a SLURM node list, one a line, in order: what `scontrol show hostnames` prints, without SLURM
installed (recipes/rsipo.sbatch takes the first as the rendezvous host; its dry run needs no cluster).

    python scripts/slurm_hosts.py 'gpu[01-03,07],login-2'     # gpu01 gpu02 gpu03 gpu07 login-2

The syntax: comma-separated names, each with at most one bracket group of comma-separated numbers and ranges
(a range keeps its zero padding: [08-10] → 08 09 10). An empty or malformed list is an error naming it.
Test: pytest tests/test_slurm.py
"""
from __future__ import annotations

import re
import sys

_NAME = re.compile(r"([^\[\],]+)(?:\[([0-9,\-]+)\])?([^\[\],]*)")


def hosts(nodelist: str) -> list[str]:
    """Expand a SLURM node list ("gpu[01-02,05],cpu1") into host names, in its order."""
    out, pos, text = [], 0, nodelist.strip()
    while pos < len(text):
        m = _NAME.match(text, pos)
        if not m:
            raise ValueError(f"SLURM node list {nodelist!r}: cannot read it at {text[pos:]!r}")
        head, group, tail = m.groups()
        for part in group.split(",") if group else [None]:
            if part is None:
                out.append(head + tail)
                continue
            lo, _, hi = part.partition("-")
            if not lo.isdigit() or (hi and not hi.isdigit()) or (hi and int(hi) < int(lo)):
                raise ValueError(f"SLURM node list {nodelist!r}: bad range {part!r}")
            out += [f"{head}{str(i).zfill(len(lo))}{tail}" for i in range(int(lo), int(hi or lo) + 1)]
        pos = m.end()
        if pos < len(text):
            if text[pos] != ",":
                raise ValueError(f"SLURM node list {nodelist!r}: cannot read it at {text[pos:]!r}")
            pos += 1
    if not out:
        raise ValueError(f"SLURM node list {nodelist!r} is empty")
    return out


if __name__ == "__main__":
    try:
        print("\n".join(hosts(sys.argv[1] if len(sys.argv) > 1 else "")))
    except ValueError as e:
        sys.exit(f"error: {e}")
