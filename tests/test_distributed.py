"""The process group on GPU (distributed.setup, distributed.backend), every collective through distributed.py,
and the start-up diagnosis of a GPU that torch cannot see (distributed.why_no_gpu)."""
import ast
import os
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import distributed as D  # noqa: E402
import train as T  # noqa: E402

COLLECTIVES = {"all_reduce", "all_gather", "all_gather_object", "all_gather_into_tensor", "broadcast",
               "broadcast_object_list", "barrier", "reduce", "reduce_scatter", "reduce_scatter_tensor", "gather",
               "gather_object", "scatter", "scatter_object_list", "send", "recv", "all_to_all", "monitored_barrier"}


def test_setup_on_gpu_sets_the_device_first_and_makes_a_group_with_a_cpu_backend(monkeypatch):
    """Under NCCL alone, a reduction of host numbers fails ("No backend type associated with device type cpu",
    seen on an H200): the group must carry gloo for CPU tensors, and the device must be set before it."""
    calls = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: calls.append(("set_device", d)))
    monkeypatch.setattr(D.dist, "is_initialized", lambda: any(c[0] == "init" for c in calls))
    monkeypatch.setattr(D.dist, "init_process_group", lambda backend, **kw: calls.append(("init", backend, kw)))
    monkeypatch.setattr(D.dist, "get_rank", lambda: 3)
    monkeypatch.setattr(D.dist, "get_world_size", lambda: 8)
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("LOCAL_RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "8")
    try:
        assert D.setup(timeout_min=90) == (3, 8)
    finally:
        D.RANK, D.WORLD = 0, 1
    assert calls[0] == ("set_device", 3)
    name, backend, kw = calls[1]
    assert name == "init" and backend == "cpu:gloo,cuda:nccl"
    assert kw["device_id"] == torch.device("cuda", 3)
    assert kw["timeout"].total_seconds() == 90 * 60


def test_cpu_runs_use_gloo_alone():
    assert D.backend(False) == "gloo" and D.backend(True) == "cpu:gloo,cuda:nccl"


def _collective_calls(path: Path) -> list[str]:
    """`dist.<collective>(...)` / `torch.distributed.<collective>(...)` calls in a file, as 'file:line name'."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in COLLECTIVES:
            base = ast.unparse(node.func.value)
            if base in ("dist", "torch.distributed", "torch_dist"):
                out.append(f"{path.name}:{node.lineno} {base}.{node.func.attr}")
    return out


def test_every_collective_goes_through_distributed_py():
    """One module decides where a collective's tensors live; the project's other files call it."""
    files = [p for p in list(ROOT.glob("*.py")) + list((ROOT / "scripts").glob("*.py")) if p.name != "distributed.py"]
    assert len(files) > 10
    bad = [c for p in files for c in _collective_calls(p)]
    assert not bad, bad
    assert _collective_calls(ROOT / "distributed.py")   # the scan does find them where they are


def test_why_no_gpu_names_the_build_the_driver_and_what_to_do():
    assert "CPU build" in D.why_no_gpu(None, "580.65.06")
    assert "no NVIDIA driver" in D.why_no_gpu("13.0", None)
    old = D.why_no_gpu("13.0", "570.86.15")
    assert "570.86.15" in old and "580 or newer" in old and "too old" in old
    assert "too old" not in D.why_no_gpu("13.0", "580.65.06")
    assert "too old" not in D.why_no_gpu("12.8", "570.86.15") and "too old" in D.why_no_gpu("12.8", "515.43.04")


@pytest.mark.parametrize("text, version", [
    ("NVRM version: NVIDIA UNIX x86_64 Kernel Module  570.86.15  Fri Jan 24 05:37:49 UTC 2025\n", "570.86.15"),
    ("NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  580.159.04  Release Build  (dvs-builder@U22)\n",
     "580.159.04")])
def test_nvidia_driver_reads_the_kernel_modules_version(tmp_path, text, version):
    (tmp_path / "version").write_text(text)
    assert D.nvidia_driver(str(tmp_path / "version")) == version
    assert D.nvidia_driver(str(tmp_path / "absent")) is None


def test_vllm_on_a_machine_without_a_usable_gpu_says_why():
    if torch.cuda.is_available():
        pytest.skip("a GPU is visible")
    with pytest.raises(SystemExit) as e:
        T.parse_args(["--engine", "vllm", "--model", "Qwen/Qwen2.5-7B-Instruct"])
    why = D.why_no_gpu(torch.version.cuda, D.nvidia_driver())
    assert str(e.value).startswith("error: --engine") and why in str(e.value), str(e.value)
