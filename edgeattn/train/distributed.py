"""Scale-out through PyTorch's own engine: the same script under ``torchrun`` runs data-parallel.

    torchrun --nproc-per-node 2 -m edgeattn.cli.main train ...    # or the `edgeattn` script's path

``torchrun`` sets RANK / LOCAL_RANK / WORLD_SIZE; with WORLD_SIZE > 1 we join a process group (NCCL on
GPUs, gloo on CPU), wrap the model in ``DistributedDataParallel``, give each rank its own shard of the
training data and write checkpoints from rank 0 only. ``--batch-size`` is per rank: the global batch is
``batch_size * world_size``.

Models that do not fit one device shard their parameters, gradients and optimizer state with FSDP2
(``torch.distributed.fsdp.fully_shard``, ``--fsdp``): each block is sharded, then the root. Checkpoints
are gathered to full tensors on rank 0, so an FSDP checkpoint is an ordinary EdgeLM checkpoint.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from edgeattn._deps import require

torch = require("torch")
dist = torch.distributed


@dataclass(frozen=True)
class DistInfo:
    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    device: str = "cpu"
    owns_group: bool = False  # we joined the process group (and so leave it); False when the caller did

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def resolve_device(device: str, local_rank: int = 0) -> str:
    """ "auto" -> "cuda:{local_rank}" when a GPU is there, else "cpu"; "cuda" gets the local rank too."""
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda":
        if not torch.cuda.is_available():
            raise ValueError("--device cuda was asked for, but torch sees no CUDA device")
        device = f"cuda:{local_rank}"
    if not (device == "cpu" or device.startswith("cuda")):
        raise ValueError(f"device must be auto, cpu or cuda, got {device!r}")
    return device


def init_distributed(device: str = "auto") -> DistInfo:
    """Join the process group that torchrun describes in the environment (nothing to do without it)."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank, local_rank = int(os.environ.get("RANK", "0")), int(os.environ.get("LOCAL_RANK", "0"))
    dev = resolve_device(device, local_rank)
    owns = world_size > 1 and not dist.is_initialized()
    if owns:
        if dev.startswith("cuda"):
            torch.cuda.set_device(dev)
        dist.init_process_group(backend="nccl" if dev.startswith("cuda") else "gloo")
    return DistInfo(rank=rank, local_rank=local_rank, world_size=world_size, device=dev, owns_group=owns)


def shutdown(info: DistInfo, *, clean: bool = True) -> None:
    """Leave the process group we joined. ``clean`` (training finished on this rank, so on every rank)
    first waits at a barrier: a rank that tears gloo down while a peer's collective is still in flight
    can abort at exit (pytorch/pytorch#179291). After an error there is no barrier, since the other
    ranks may never reach it."""
    if info.owns_group and dist.is_initialized():
        if clean:
            dist.barrier()
        dist.destroy_process_group()


def wrap_model(model, info: DistInfo, *, fsdp: bool = False):
    """DDP (or FSDP2 with ``fsdp``) around ``model`` when distributed; the model itself otherwise."""
    if fsdp:
        from torch.distributed.fsdp import fully_shard

        if not info.enabled:
            raise ValueError(
                "--fsdp shards a model across processes: launch with torchrun --nproc-per-node N"
            )
        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
        return model
    if not info.enabled:
        return model
    from torch.nn.parallel import DistributedDataParallel

    device_ids = [torch.device(info.device).index] if info.device.startswith("cuda") else None
    return DistributedDataParallel(model, device_ids=device_ids)


def all_reduce_sum(t, info: DistInfo):
    if info.enabled:
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t


def broadcast(t, info: DistInfo, src: int = 0):
    if info.enabled:
        dist.broadcast(t, src)
    return t


def barrier(info: DistInfo) -> None:
    if info.enabled:
        dist.barrier()
