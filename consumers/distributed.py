"""Data-parallel training under ``torchrun``: rank 0 is the trainer, the other ranks follow.

    torchrun --nproc-per-node N -m streamer train --config run.toml

Rank 0 runs the whole :class:`~consumers.trainer.Trainer`: it is the one reader of the
trajectory stream, so the exactly-once bookkeeping (filters, staleness, high-water id,
acknowledge after checkpoint) stays in one process, exactly as with one device. Each
trainer step it broadcasts the collated batch (plain tensors, never pickle) to every rank.
Every rank then runs the same :class:`~consumers.learner.Learner` step on its share of the
rows of each minibatch (rows ``rank::world``): the loss denominators are those of the whole
minibatch, the gradients are summed over ranks before clipping and the optimizer step, so
the summed gradient is the single-device gradient and every rank keeps identical fp32
weights and AdamW state (replicated data parallelism, DDP's semantics without its wrapper:
the learner's micro-batch loop owns when gradients are reduced). Rank 0 alone writes
weights and checkpoints; at start every rank restores the checkpoint rank 0 chose.

A rank that dies takes the step's collective down with it; torchrun then stops the other
ranks, and a restart resumes from the last checkpoint like a single trainer's restart:
the entries trained since are still pending and are trained again, once.

With ``trainer.fsdp = true`` the ranks shard the weights instead of replicating them
(FSDP2): which of the two the learner does is one object chosen at its construction
(consumers/strategy.py).
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from consumers import checkpoint
from consumers.batch import Batch

log = logging.getLogger(__name__)

# the tensors a collated batch travels as, in order: (name, dtype, (rows, cols) -> shape)
_FIELDS = (
    ("input_ids", torch.int64, lambda b, t: (b, t)),
    ("attention_mask", torch.int64, lambda b, t: (b, t)),
    ("weights", torch.float32, lambda b, t: (b, t - 1)),
    ("sampler_logp", torch.float32, lambda b, t: (b, t - 1)),
    ("advantages", torch.float32, lambda b, t: (b,)),
)
_STOP, _BATCH, _RESTORE, _CHECKPOINT = 0, 1, 2, 3


def launch(nproc: int, argv: list[str]) -> None:
    """``streamer train --nproc N``: replace this process with torchrun running N ranks of
    the same command (``argv`` without ``--nproc``) on this machine."""
    args = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
    args += ["-m", "streamer", *argv]
    log.info("starting %d data-parallel ranks: %s", nproc, " ".join(args[1:]))
    os.execv(sys.executable, args)


def without_nproc(argv: list[str]) -> list[str]:
    """``argv`` with any ``--nproc N`` / ``--nproc=N`` removed."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a == "--nproc":
            skip = True
        elif not a.startswith("--nproc="):
            out.append(a)
    return out


def world() -> tuple[int, int, int]:
    """(rank, world size, local rank) from torchrun's environment; (0, 1, 0) without it."""
    env = os.environ
    return int(env.get("RANK", 0)), int(env.get("WORLD_SIZE", 1)), int(env.get("LOCAL_RANK", 0))


class DataParallel:
    """The collectives of one data-parallel trainer; ``device`` is where they run."""

    def __init__(self, device: torch.device, *, sharded: bool = False):
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.device, self.sharded = device, sharded

    @classmethod
    def init(cls, *, sharded: bool = False) -> DataParallel | None:
        """Join torchrun's process group (NCCL on GPUs, gloo on CPUs); None when not under torchrun."""
        rank, size, local = world()
        if size <= 1:
            return None
        cuda = torch.cuda.is_available()
        if cuda:
            torch.cuda.set_device(local)
        dist.init_process_group("nccl" if cuda else "gloo")
        device = torch.device("cuda", local) if cuda else torch.device("cpu")
        log.info("data-parallel rank %d of %d on %s%s", rank, size, device, " (FSDP)" if sharded else "")
        return cls(device, sharded=sharded)

    # ---------------------------------------------------------------- what the learner asks

    def shard(self, batch: Batch) -> Batch:
        """This rank's rows of ``batch`` (``rank::world``; may be empty)."""
        return batch.rows(torch.arange(self.rank, batch.size, self.world))

    def sum_grads(self, params: list[torch.nn.Parameter]) -> None:
        """Sum the gradients over ranks (a rank whose share had no rows contributes zeros)."""
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        flat = torch.cat([p.grad.reshape(-1) for p in params])  # one collective, not one per tensor
        dist.all_reduce(flat, op=dist.ReduceOp.SUM)
        offset = 0
        for p in params:
            n = p.numel()
            p.grad.copy_(flat[offset : offset + n].view_as(p.grad))
            offset += n

    def sum_metrics(self, values: dict[str, float], *, maxima: tuple[str, ...] = ()) -> dict[str, float]:
        """Per-rank partial metrics summed (or max-ed, for ``maxima``) over ranks."""
        names = sorted(values)
        t = torch.tensor([values[k] for k in names], dtype=torch.float64, device=self.device)
        m = torch.tensor(
            [values[k] if k in maxima else 0.0 for k in names], dtype=torch.float64, device=self.device
        )
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
        dist.all_reduce(m, op=dist.ReduceOp.MAX)
        return {k: float(m[i] if k in maxima else t[i]) for i, k in enumerate(names)}

    # ---------------------------------------------------------------- rank 0 -> followers

    def send_batch(self, batch: Batch) -> None:
        """Rank 0: the step's batch to every rank (a header, then the tensors)."""
        rows, cols = batch.input_ids.shape
        self._header(_BATCH, rows, cols)
        for name, dtype, _ in _FIELDS:
            dist.broadcast(getattr(batch, name).to(self.device, dtype).contiguous(), src=0)

    def send_restore(self, name: str) -> None:
        """Rank 0: the checkpoint every rank restores from ("" = the initial weights)."""
        raw = torch.tensor(list(name.encode()), dtype=torch.uint8, device=self.device)
        self._header(_RESTORE, len(raw), 0)
        if len(raw):
            dist.broadcast(raw, src=0)

    def send_stop(self) -> None:
        self._header(_STOP, 0, 0)

    def send_checkpoint(self) -> None:
        """Rank 0: a checkpoint is being written; every rank calls ``learner.optimizer_state()``
        (sharded, a collective gather)."""
        self._header(_CHECKPOINT, 0, 0)

    def receive(self) -> tuple[str, Batch | str | None]:
        """Followers: the next message: ("batch", Batch), ("restore", name), ("checkpoint",
        None) or ("stop", None)."""
        kind, rows, cols = self._header()
        if kind == _STOP:
            return "stop", None
        if kind == _CHECKPOINT:
            return "checkpoint", None
        if kind == _RESTORE:
            raw = torch.empty(rows, dtype=torch.uint8, device=self.device)
            if rows:
                dist.broadcast(raw, src=0)
            return "restore", bytes(raw.cpu().tolist()).decode()
        fields = {}
        for name, dtype, shape in _FIELDS:
            t = torch.empty(shape(rows, cols), dtype=dtype, device=self.device)
            dist.broadcast(t, src=0)
            fields[name] = t
        return "batch", Batch(**fields)

    def _header(self, *values: int) -> tuple[int, int, int]:
        h = torch.tensor(values or (0, 0, 0), dtype=torch.int64, device=self.device)
        dist.broadcast(h, src=0)
        return tuple(int(v) for v in h.tolist())

    def leave(self, code: int = 0):
        """Close cleanly and end the process at once: interpreter teardown with gloo's threads
        alive can end in std::terminate (SIGABRT), which torchrun reports as a failure. For a
        rank with nothing left to write."""
        self.close(clean=True)
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)

    def close(self, *, clean: bool = False) -> None:
        """Leave the process group. ``clean``: every rank is closing normally, so wait for all of
        them first (a rank tearing gloo down while another still sends aborts the process)."""
        if dist.is_initialized():
            if clean:
                dist.barrier()
            dist.destroy_process_group()


def follow(learner, dp: DataParallel) -> int:
    """A rank > 0 under torchrun: restore what rank 0 restores, then train the batches it
    broadcasts until it says stop, with its :class:`~consumers.learner.Learner`. No Redis,
    no files written: rank 0 owns both."""
    while True:
        kind, payload = dp.receive()
        if kind == "stop":  # the caller leaves the group (DataParallel.leave)
            log.info("rank %d: stopped at step %d", dp.rank, learner.step)
            return 0
        if kind == "restore":
            if payload:
                learner.restore(Path(payload), checkpoint.read_meta(Path(payload)))
            learner.gather()
        elif kind == "checkpoint":
            learner.optimizer_state()  # rank 0 writes what every rank gathers
        elif kind == "batch":
            learner.train_step(payload)
