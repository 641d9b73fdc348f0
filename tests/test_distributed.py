"""The process group on GPU (distributed.setup, distributed.backend), every collective through infra/distributed.py,
and the start-up diagnosis of a GPU that torch cannot see (distributed.why_no_gpu)."""
import ast
import os
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from infra import distributed as D  # noqa: E402
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
    files = [p for d in ("", "infra", "harness", "scripts") for p in (ROOT / d).glob("*.py")
             if p != ROOT / "infra/distributed.py"]
    assert len(files) > 10
    bad = [c for p in files for c in _collective_calls(p)]
    assert not bad, bad
    assert _collective_calls(ROOT / "infra/distributed.py")   # the scan does find them where they are


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


SHARDED_LOAD = """
import json, sys, torch
sys.path.insert(0, sys.argv[1])
from infra import distributed as D
from transformers import AutoModelForCausalLM
D.setup()
calls = []
real = AutoModelForCausalLM.from_pretrained.__func__
AutoModelForCausalLM.from_pretrained = classmethod(lambda cls, *a, **k: calls.append(a[0]) or real(cls, *a, **k))
model = D.load_sharded(sys.argv[2], torch.float32, torch.device("cpu"))
full = D.full_state(model)                       # every rank: the whole model, gathered
ref = real(AutoModelForCausalLM, sys.argv[2], dtype=torch.float32)
want = ref.state_dict()
copy = D.unsharded_copy(model, torch.float32, torch.device("cpu"))
roll = D.rollout_copy(model, torch.bfloat16, torch.device("cpu"))   # the GPU path's rollout copy, on CPU
ref_buffers = dict(ref.named_buffers())
teacher = D.sharded_like(model, torch.float32, torch.device("cpu"))   # an EMA teacher: built empty, no read
D.ema_params(teacher, model, 0.0)
teacher_full = D.full_state(teacher)
model.unshard()                                  # the root gathered, as after a no-grad forward that kept it so
try:
    D.ema_params(teacher, model, 0.5)
    guard = False
except RuntimeError as e:
    guard = "gathered" in str(e)
model.reshard()
out = {"rank": D.RANK,
       "teacher_equal": sorted(teacher_full) == sorted(want)
                        and all(torch.equal(teacher_full[k], want[k]) for k in want),
       "teacher_sharded": all(hasattr(p, "to_local") for p in teacher.parameters()),
       "teacher_tied": teacher.lm_head.weight is teacher.model.embed_tokens.weight,
       "teacher_buffers": all(torch.equal(b, ref_buffers[n]) for n, b in teacher.named_buffers()),
       "ema_guard": guard, "from_pretrained_calls": len(calls),
       "sharded": all(hasattr(p, "to_local") for p in model.parameters()),
       "local_numel": sum(p.to_local().numel() for p in model.parameters()),
       "total_numel": sum(p.numel() for p in ref.parameters()),
       "params_equal": sorted(full) == sorted(want) and all(torch.equal(full[k], want[k]) for k in want),
       "buffers_equal": all(torch.equal(b, dict(ref.named_buffers())[n]) for n, b in model.named_buffers()),
       "n_buffers": len(list(model.named_buffers())),
       "copy_equal": all(torch.equal(v, want[k]) for k, v in copy.state_dict().items()),
       "eos": model.generation_config.eos_token_id,
       "tied": model.lm_head.weight is model.model.embed_tokens.weight
               and len(list(model.parameters())) == len(list(ref.parameters())),
       "copy_tied": copy.lm_head.weight is copy.model.embed_tokens.weight,
       "roll_params_bf16": all(p.dtype == torch.bfloat16 for p in roll.parameters()),
       "roll_buffers_exact": all(b.dtype == ref_buffers[n].dtype and torch.equal(b, ref_buffers[n])
                                 for n, b in roll.named_buffers()) and len(list(roll.named_buffers())) >= 1,
       "roll_tied": roll.lm_head.weight is roll.model.embed_tokens.weight}
open(sys.argv[3] + f"/rank{D.RANK}.json", "w").write(json.dumps(out))
D.barrier()
torch.distributed.destroy_process_group()
D.exit_process(0)   # no gloo teardown abort after the work is done
"""


def _tiny_qwen_folder(path: Path) -> Path:
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM
    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                      num_key_value_heads=1, tie_word_embeddings=True, eos_token_id=3)
    m = Qwen2ForCausalLM(cfg)
    m.generation_config = GenerationConfig(eos_token_id=[3, 5])
    m.save_pretrained(path)
    return path


@pytest.mark.skipif(sys.platform != "linux", reason="torchrun with gloo is tested on Linux")
def test_a_real_model_is_sharded_as_it_loads(tmp_path):
    """2 gloo ranks: only rank 0 reads the checkpoint; each rank holds half the parameters; gathered, they are
    the checkpoint's, the rotary buffers (no part of the state dict) too, and so is the unsharded copy; an EMA
    teacher built empty beside it takes the policy's weights without reading the checkpoint again."""
    import json
    import subprocess
    folder = _tiny_qwen_folder(tmp_path / "m")
    (tmp_path / "w.py").write_text(SHARDED_LOAD)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", "29571",
           str(tmp_path / "w.py"), str(ROOT), str(folder), str(tmp_path)]
    r = subprocess.run(cmd, env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    r0, r1 = (json.loads((tmp_path / f"rank{i}.json").read_text()) for i in (0, 1))
    assert (r0["from_pretrained_calls"], r1["from_pretrained_calls"]) == (1, 0)
    for r in (r0, r1):
        assert r["sharded"] and r["params_equal"] and r["buffers_equal"] and r["copy_equal"] and r["n_buffers"] >= 1
        assert r["eos"] == [3, 5]                                  # the checkpoint's generation config
        assert r["tied"] and r["copy_tied"]                        # one embedding matrix, as in the checkpoint
        # the rollout copy: parameters in bf16, the rotary frequencies the policy's own fp32 values
        assert r["roll_params_bf16"] and r["roll_buffers_exact"] and r["roll_tied"]
        # the EMA teacher: sharded like the policy, filled from it with no file read (one read, rank 0's, in all),
        # and an average into a gathered root is refused
        assert r["teacher_equal"] and r["teacher_sharded"] and r["teacher_tied"] and r["teacher_buffers"]
        assert r["ema_guard"]
    assert r0["local_numel"] + r1["local_numel"] == r0["total_numel"] and r1["local_numel"] < r0["total_numel"]


def test_the_rollout_copy_keeps_the_policys_buffers_in_their_dtype():
    """The HF engine's rollout copy on a GPU has bf16 parameters; its buffers (rotary inv_freq) must stay the
    policy's fp32 values: rounded to bf16, the angle at position p is off by p × the rounding error."""
    from transformers import Qwen2Config, Qwen2ForCausalLM
    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=64, hidden_size=64, intermediate_size=64, num_hidden_layers=1, num_attention_heads=1,
                      num_key_value_heads=1, tie_word_embeddings=True)
    policy = Qwen2ForCausalLM(cfg)
    roll = D.rollout_copy(policy, torch.bfloat16, torch.device("cpu"))
    buffers = dict(policy.named_buffers())
    assert buffers and all(p.dtype == torch.bfloat16 for p in roll.parameters())
    for n, b in roll.named_buffers():
        assert b.dtype == buffers[n].dtype == torch.float32 and torch.equal(b, buffers[n]), n
    assert roll.lm_head.weight is roll.model.embed_tokens.weight and not roll.training
    assert all(p.dtype == torch.float32 for p in policy.parameters())      # the policy itself is untouched
    # what casting the whole copy did: inv_freq rounded, the angle at position 2,048 off by up to ~1 rad
    rounded = buffers["model.rotary_emb.inv_freq"].to(torch.bfloat16).float()
    assert (2048 * (rounded - buffers["model.rotary_emb.inv_freq"])).abs().max() > 0.1


def test_several_hosts_with_a_loopback_hostname_are_refused_with_what_to_set():
    two_hosts = {"WORLD_SIZE": "16", "LOCAL_WORLD_SIZE": "8"}
    why = D.loopback_gloo(two_hosts, resolve=lambda host: "127.0.1.1")
    assert why and "GLOO_SOCKET_IFNAME" in why and "127.0.1.1" in why
    assert D.loopback_gloo(two_hosts, resolve=lambda host: "10.0.0.7") is None              # a routable address
    assert D.loopback_gloo({**two_hosts, "GLOO_SOCKET_IFNAME": "eth0"}, resolve=lambda h: "127.0.1.1") is None
    assert D.loopback_gloo({"WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "8"}, resolve=lambda h: "127.0.1.1") is None


def test_slurm_tasks_without_torchrun_are_refused_naming_torchrun(monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.setenv("SLURM_NTASKS", "8")
    with pytest.raises(SystemExit, match="without torchrun.*srun --ntasks-per-node 1 torchrun"):
        D.setup()


GRAD_CKPT = """
import json, sys, torch
sys.path.insert(0, sys.argv[1])
from infra import distributed as D
from transformers import Qwen2Config, Qwen2ForCausalLM
D.setup()
cfg = Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                  num_key_value_heads=1, tie_word_embeddings=True)
out = {}
for ckpt in (False, True):
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(cfg)
    if ckpt:   # as build_policy does before sharding (the GPU default)
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model = D.shard(model)
    model.train()
    torch.manual_seed(1 + D.RANK)   # each rank its own batch
    ids = torch.randint(0, 64, (2, 12))
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    out[ckpt] = (loss.item(), {n: p.grad.full_tensor().clone() for n, p in model.named_parameters()})
(l0, g0), (l1, g1) = out[False], out[True]
res = {"loss_equal": l0 == l1, "max_grad_diff": max(float((g0[n] - g1[n]).abs().max()) for n in g0),
       "grad_norm": sum(float(g.norm()) for g in g0.values())}
open(sys.argv[2] + f"/rank{D.RANK}.json", "w").write(json.dumps(res))
D.barrier()
torch.distributed.destroy_process_group()
D.exit_process(0)   # no gloo teardown abort after the work is done
"""


@pytest.mark.skipif(sys.platform != "linux", reason="torchrun with gloo is tested on Linux")
def test_fsdp2_with_activation_checkpointing_gives_the_same_loss_and_gradients(tmp_path):
    """The GPU default (--grad_ckpt true under FSDP2), on 2 gloo ranks: recomputing each block in the backward
    changes neither the loss nor a single gradient."""
    import json
    import subprocess
    (tmp_path / "w.py").write_text(GRAD_CKPT)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", "29575",
           str(tmp_path / "w.py"), str(ROOT), str(tmp_path)]
    r = subprocess.run(cmd, env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    for i in (0, 1):
        res = json.loads((tmp_path / f"rank{i}.json").read_text())
        assert res["loss_equal"] and res["max_grad_diff"] == 0.0 and res["grad_norm"] > 0, res
