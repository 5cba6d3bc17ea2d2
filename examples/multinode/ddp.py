"""A complete PyTorch DDP trial across trialkeeper's nodes: one process per environment.

trialkeeper starts this script once on each of the trial's `trialNodes` environments with
torchrun's variables set (MASTER_ADDR, MASTER_PORT, WORLD_SIZE, RANK, LOCAL_RANK), so
`init_process_group("env://")` joins them. Rank 0 reports the results and saves the
checkpoints; a retried trial continues from rank 0's newest checkpoint on every node.
With several GPUs per node, run it under torchrun instead (see config.yml)."""

import os
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from trialkeeper.agent import trial

backend = "nccl" if torch.cuda.is_available() else "gloo"
dist.init_process_group(backend, init_method="env://")
rank, world = dist.get_rank(), dist.get_world_size()
device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if backend == "nccl" else torch.device("cpu")

params = trial.get_next_parameter()
torch.manual_seed(0)
ids = [device.index] if device.index is not None else None
model = DistributedDataParallel(torch.nn.Linear(16, 1).to(device), device_ids=ids)
optimizer = torch.optim.SGD(model.parameters(), lr=params.get("lr", 0.01))

start = 0
# Empty on a fresh start; continued, it holds rank 0's last checkpoint, on every node.
saved = Path(trial.get_checkpoint_dir()) / "model.pt"
if saved.exists():
    state = torch.load(saved, map_location=device)
    model.module.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    start = state["epoch"] + 1

for epoch in range(start, params.get("epochs", 5)):
    x = torch.randn(256, 16, device=device)  # each rank its own shard of data
    loss = torch.nn.functional.mse_loss(model(x), x.sum(dim=1, keepdim=True))
    optimizer.zero_grad()
    loss.backward()  # DDP all-reduces the gradients across the nodes here
    optimizer.step()
    mean = loss.detach().clone()
    dist.all_reduce(mean)
    mean = mean.item() / world
    if rank == 0:
        trial.report_intermediate_result(mean)
        torch.save({"model": model.module.state_dict(), "optimizer": optimizer.state_dict(), "epoch": epoch}, saved)
        trial.save_checkpoint(epoch)  # rank 0's checkpoint is the trial's
    dist.barrier()

if rank == 0:
    trial.report_final_result(mean)
dist.destroy_process_group()
