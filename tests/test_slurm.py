"""recipes/rsipo.sbatch: valid bash, its dry run printing one torchrun line per node of a given node list with the
rendezvous on the first and the recipe's flags (which train.py parses), and scripts/slurm_hosts.py's expansion of
SLURM node lists, by hand."""
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))
import slurm_hosts  # noqa: E402
import train as T  # noqa: E402

SBATCH = ROOT / "recipes" / "rsipo.sbatch"


def test_node_lists_expand_as_scontrol_does():
    assert slurm_hosts.hosts("gpu[01-03,07],login-2") == ["gpu01", "gpu02", "gpu03", "gpu07", "login-2"]
    assert (slurm_hosts.hosts("n[8-10]") == ["n8", "n9", "n10"]
            and slurm_hosts.hosts("n[08-10]") == ["n08", "n09", "n10"])
    assert slurm_hosts.hosts("a,b[1]") == ["a", "b1"]
    for bad in ("", "gpu[3-1]", "gpu[a-b]", "gpu[1-2"):
        with pytest.raises(ValueError, match="SLURM node list"):
            slurm_hosts.hosts(bad)


def test_the_sbatch_file_is_valid_bash_with_the_settings_a_preemptible_job_needs():
    assert subprocess.run(["bash", "-n", str(SBATCH)], capture_output=True).returncode == 0
    text = SBATCH.read_text()
    for line in ("#SBATCH --signal=TERM@360", "#SBATCH --ntasks-per-node=1", "--cpus-per-task \"$SLURM_CPUS_PER_TASK\"",
                 "--shutdown_timeout $GRACE"):
        assert line in text, line


def test_the_dry_run_prints_each_nodes_torchrun_with_the_rendezvous_on_the_first(monkeypatch):
    env = dict(os.environ, DRY_RUN="1", SLURM_JOB_NODELIST="gpu[07-08]", SLURM_NNODES="2", SLURM_JOB_ID="42")
    r = subprocess.run(["bash", str(SBATCH)], cwd=ROOT, env=env, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.strip().splitlines()
    assert [x.split(":", 1)[0] for x in lines] == ["gpu07", "gpu08"]
    for line in lines:
        cmd = shlex.split(line.split(": ", 1)[1])
        assert cmd[:2] == ["torchrun", "--nnodes"] and cmd[2] == "2"
        assert cmd[cmd.index("--rdzv_endpoint") + 1] == "gpu07:29500" and cmd[cmd.index("--rdzv_id") + 1] == "42"
        flags = cmd[cmd.index("train.py") + 1:]
        monkeypatch.setattr(T.Args, "validate", lambda self: None)   # no GPU here to check --engine vllm against
        a = T.parse_args(flags)
        assert (a.engine, a.algo, a.steps, a.model, a.run_name) == ("vllm", "rsipo", 150, "runs/q7b_sft/warm_start",
                                                                    "q7b_alf")
    outside = {k: v for k, v in env.items() if k != "SLURM_JOB_NODELIST"}
    r = subprocess.run(["bash", str(SBATCH)], cwd=ROOT, env=outside, capture_output=True, text=True)
    assert r.returncode != 0 and "not inside a SLURM job" in r.stderr
