"""Training under torchrun: torch.distributed's DistributedDataParallel, one process per rank (gloo on CPU, nccl on CUDA).

The rule every trainer follows, so that N processes take the optimisation path of one process over the same batch:
  - every rank draws the same *global* batch from the same data RNG (a function of the seed and the step, never of
    the rank count) and keeps its own rows (`World.shard`: batch / world each, the batch refused when it does not
    divide);
  - the trained module runs under DDP (`World.wrap`), which averages the ranks' gradients: with equal shards that is
    the full batch's mean gradient, up to float summation order; the frozen model a loss reads stays outside DDP;
  - a checkpoint holds global state only (weights, optimizer, data RNG, step): it resumes under any world size;
  - rank 0 alone writes files, shows progress and logs (`World.main`); logged losses are all-reduced means;
  - self-distillation data is generated sharded (`World.mine`: indices rank, rank + N, ...) and gathered back in
    the one-process order (`World.gather`), so every rank holds the same data.
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from typing import Callable, Iterator

import torch
import torch.distributed as dist
from torch import Tensor, nn

from ..errors import ConfigError

# A rank can wait long at a collective while rank 0 alone evaluates or writes (a pretraining evaluation, a large
# checkpoint): torch's default of 30 minutes would end a healthy run.
TIMEOUT = timedelta(hours=6)


@dataclass(frozen=True)
class World:
    """This process's place among the training processes (rank 0 of 1 when not launched by torchrun)."""

    rank: int = 0
    size: int = 1
    local_rank: int = 0  # the rank within its machine: its CUDA device

    @property
    def main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.size > 1

    @staticmethod
    def current() -> "World":
        """The running process group's ranks, else torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK), else one process."""
        if dist.is_available() and dist.is_initialized():
            return World(dist.get_rank(), dist.get_world_size(), int(os.environ.get("LOCAL_RANK", dist.get_rank())))
        env = os.environ
        return World(int(env.get("RANK", 0)), int(env.get("WORLD_SIZE", 1)), int(env.get("LOCAL_RANK", 0)))

    def check_batch(self, batch_size: int, flag: str = "--batch-size") -> None:
        """The global batch is split into equal shards, one per rank: refuse one that does not split."""
        if batch_size % self.size:
            raise ConfigError(f"{flag} {batch_size} is the global batch, split equally over {self.size} processes: "
                              f"make it a multiple of {self.size}")

    def shard(self, batch: Tensor) -> Tensor:
        """This rank's rows of a global batch (B, ...) -> (B / world, ...)."""
        n = batch.shape[0] // self.size
        return batch[self.rank * n : (self.rank + 1) * n]

    def mine(self, n: int) -> list[int]:
        """This rank's share of n work items (generation prompts, text windows): rank, rank + world, ..."""
        return list(range(self.rank, n, self.size))

    def gather(self, mine: list) -> list:
        """Every rank's results of `mine(n)` in the order of range(n), on every rank."""
        if not self.distributed:
            return mine
        parts: list = [None] * self.size
        dist.all_gather_object(parts, mine)
        return [parts[i % self.size][i // self.size] for i in range(sum(len(p) for p in parts))]

    def wrap(self, trained: nn.Module, loss: Callable, find_unused: bool = False) -> Callable:
        """`loss(*batch)` with the gradients of `trained` averaged over the ranks: DDP around the trained module
        and its loss (one process: the loss itself). `loss` reads `trained` and any frozen model directly; only
        `trained` is DDP's. find_unused: some trained parameters get no gradient (layers a depth never reaches)."""
        if not self.distributed:
            return loss
        ids = [self.local_rank] if next(trained.parameters()).device.type == "cuda" else None
        # buffers (rotary tables) are never trained: synced once at the start, not before every forward
        return nn.parallel.DistributedDataParallel(_Objective(trained, loss), device_ids=ids, forward_sync_buffers=False,
                                                   find_unused_parameters=find_unused)

    def mean(self, values: dict[str, float]) -> dict[str, float]:
        """Logged numbers averaged over the ranks (each a mean over equal shards: the global batch's value)."""
        if not self.distributed or not values:
            return values
        t = torch.tensor(list(values.values()), dtype=torch.float64, device=_device())
        dist.all_reduce(t)
        return dict(zip(values, (t / self.size).tolist()))

    def agree(self, x: float) -> float:
        """Rank 0's value of x on every rank (a clock read that must steer every rank's schedule alike)."""
        if not self.distributed:
            return x
        t = torch.tensor([x], dtype=torch.float64, device=_device())
        dist.broadcast(t, 0)
        return t.item()

    def barrier(self) -> None:
        if self.distributed:
            dist.barrier()

    @contextmanager
    def main_first(self) -> Iterator[None]:
        """Rank 0 runs the block first (it writes what the block makes: a tokenizer, an encoded stream), then the
        other ranks run it and read what it wrote."""
        if not self.main:
            self.barrier()
        yield
        if self.main:
            self.barrier()


class _Objective(nn.Module):
    """The trained module and its loss as one module: DDP averages gradients only for a forward it ran itself. The
    loss is a plain attribute, so the frozen model it reads is not DDP's to broadcast or check."""

    def __init__(self, trained: nn.Module, loss: Callable) -> None:
        super().__init__()
        self.trained = trained
        self.loss = loss

    def forward(self, *batch):
        return self.loss(*batch)


def train_device(spec: str, world: World) -> torch.device:
    """The device a trainer computes on: its --device (mtpspec.device.resolve: cpu, cuda, cuda:N; an absent one is a
    ConfigError), under torchrun on CUDA this rank's LOCAL_RANK GPU."""
    from ..device import resolve

    dev = resolve(spec)
    return torch.device("cuda", world.local_rank) if dev.type == "cuda" and world.distributed else dev


def _device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")


@contextmanager
def launch(device: str = "cpu") -> Iterator[World]:
    """The World a trainer runs in. Under torchrun (WORLD_SIZE > 1) this process joins the process group for the
    block's duration (gloo on CPU, nccl on CUDA, each rank on its LOCAL_RANK's device) and leaves it after; a group a
    caller started already is used as it is; otherwise one process."""
    world = World.current()
    own = world.distributed and not dist.is_initialized()
    if own:
        if device == "cuda":
            torch.cuda.set_device(world.local_rank)
        dist.init_process_group("nccl" if device == "cuda" else "gloo", timeout=TIMEOUT)
    try:
        yield world
    finally:
        if own:
            dist.destroy_process_group()
