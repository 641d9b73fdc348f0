"""Seconds from a scheduler's SIGTERM to the end of the job, in each long part of a run: the warm start's SFT,
the evaluation before RL, an RL step's rollout. `train.py` under torchrun on 2 CPU ranks (tiny model), the
signal sent to torchrun as SLURM sends it; the agent passes it on to the workers, which must write their
checkpoint and exit inside its --shutdown_timeout (here 30 s, torchrun's default).

    python scripts/bench_preemption.py                  # about 3 minutes on 2 cores
    python scripts/bench_preemption.py --out results/preemption.json

The update is not cut short: a signal during it waits for the step's end (`time/update` in metrics.jsonl
bounds that wait). Each phase is a fresh run; the table gives the seconds, whether the workers stopped on
their own, and the checkpoint the same command would resume from.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from infra.distributed import checkpoints  # noqa: E402

FLAGS = ["--algo", "grpo", "--steps", "2", "--tasks_per_step", "2", "--group_size", "2", "--eval_games", "12",
         "--eval_repeats", "4", "--max_turns", "20", "--mini_batch", "8", "--micro_batch", "4", "--tiny_hidden", "64",
         "--max_new_tokens", "24", "--env_workers", "1", "--save_every", "10"]

# phase → (the output that precedes it, seconds to wait after it, extra train.py flags)
PHASES = {"sft": ("steps 1..400", 1.0, ["--sft_steps", "400"]),
          "evaluation before RL": ("final loss", 0.0, ["--sft_steps", "40"]),
          "rollout of step 1": ("eval before RL", 0.0, ["--sft_steps", "40", "--max_turns", "50"])}


def torchrun_sigterm(args: list, port: int, signal_when=None, delay: float = 0.0, grace: Optional[int] = None,
                     timeout: float = 900) -> tuple[int, str, Optional[float]]:
    """`torchrun --nproc_per_node 2 ARGS` (one intra-op thread a rank, output unbuffered); with `signal_when`
    (a predicate on the output so far) SIGTERM goes to torchrun `delay` seconds after it first holds, as a
    scheduler sends it. `grace`: torchrun's shutdown timeout (its default, 30 s, when None). Returns the exit
    code, the output, and the seconds from the signal to torchrun's exit (None without a signal)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(port), *args]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    if grace is not None:
        env["TORCH_ELASTIC_SHUTDOWN_TIMEOUT"] = str(grace)
    p = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    out, sent = [], None
    for line in p.stdout:
        out.append(line)
        if signal_when is not None and sent is None and signal_when("".join(out)):
            time.sleep(delay)
            p.send_signal(signal.SIGTERM)
            sent = time.time()
    rc = p.wait(timeout=timeout)
    return rc, "".join(out), (time.time() - sent) if sent else None


def measure(phase: str, work: Path, port: int, grace: int) -> dict:
    after, delay, extra = PHASES[phase]
    run = work / phase.split()[0]
    _, log, seconds = torchrun_sigterm([str(ROOT / "train.py"), *FLAGS, *extra, "--out_dir", str(work),
                                        "--run_name", run.name], port, lambda out: after in out, delay, grace)
    ckpt = checkpoints(run) or checkpoints(run / "sft")
    return {"phase": phase, "seconds": seconds, "stopped_on_their_own": "forcefully exiting" not in log,
            "preempted_line": next((x.strip() for x in log.splitlines() if x.startswith("preempted")), None),
            "checkpoint": str(ckpt[0].relative_to(work)) if ckpt else None}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--grace", type=int, default=30, help="torchrun's shutdown timeout, seconds")
    ap.add_argument("--out", default="", help="write the results as JSON here")
    ap.add_argument("--phases", default=",".join(PHASES), help="comma list of the phases to measure")
    a = ap.parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory() as work:
        for i, phase in enumerate(p for p in PHASES if p in a.phases.split(",")):
            rows.append(measure(phase, Path(work), 29591 + i, a.grace))
            r = rows[-1]
            print(f"{phase:22s} {r['seconds']:5.2f} s from SIGTERM to exit | stopped on their own: "
                  f"{r['stopped_on_their_own']} | checkpoint {r['checkpoint']}", flush=True)
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps({"grace": a.grace, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
