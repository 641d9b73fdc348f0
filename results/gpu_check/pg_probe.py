# a "nccl" group refuses a CPU tensor; the project's "cpu:gloo,cuda:nccl" group takes both
import os, sys, torch, torch.distributed as dist
sys.path.insert(0, ".")
os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT="29611")
torch.cuda.set_device(0)
dist.init_process_group("nccl", device_id=torch.device("cuda", 0))
try:
    dist.all_reduce(torch.ones(2)); print("nccl group, CPU tensor: reduced")
except Exception as e:
    print("nccl group, CPU tensor:", type(e).__name__, str(e).splitlines()[0][:150])
dist.destroy_process_group()
os.environ["MASTER_PORT"] = "29612"
import distributed as D
D.setup()
print("project group:", dist.get_backend(), "| all_reduce of host floats:", D.all_reduce([1.0, 2.0]).tolist(),
      "| CUDA tensor:", (dist.all_reduce(t := torch.ones(2, device="cuda")), t.tolist())[1])
dist.destroy_process_group()
