"""How the learner's weights sit on the ranks: whole on each (:class:`Plain`: one device, or
replicated data parallelism) or sharded (:class:`Sharded`, ``trainer.fsdp``), one object
chosen at the learner's construction (:func:`choose`), so its step has no branches on it.

With ``trainer.fsdp = true`` the ranks shard instead of replicating (FSDP2,
``fully_shard`` on every decoder layer and the root): each rank holds 1/N of the fp32
weights, gradients and AdamW state, gathers a layer's weights for its forward and backward
(in the compute dtype, bf16 on a GPU: a ``MixedPrecisionPolicy`` with fp32 gradient
reduction) and reduce-scatters the gradients as sums. Every forward is then a collective,
so every rank runs the same number of micro-batches per minibatch (a rank short of rows
runs a zero-loss pass). After each step the ranks gather the full weights onto rank 0's CPU
for the version writer; at a checkpoint they gather the full AdamW state too. A checkpoint
is the same full, index-keyed safetensors set a single process writes, so a run can resume
under any number of ranks, sharded or not: its cost is that rank 0's host memory holds the
full fp32 state (16 bytes a parameter with AdamW: 112 GB for 7B, within a GPU node's RAM),
which per-rank shards would avoid at the price of a format tied to the world size.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch

from consumers import checkpoint
from consumers.batch import Batch
from consumers.distributed import DataParallel
from streamer import lora, weights
from streamer.errors import ConfigError


def choose(dp: DataParallel | None) -> Plain:
    """:class:`Sharded` under ``trainer.fsdp``, :class:`Plain` otherwise."""
    return Sharded(dp) if dp is not None and dp.sharded else Plain(dp)


class Plain:
    """The whole model on every rank: one device (``dp`` None), or replicated data parallelism,
    each rank training its rows with gradients and metrics summed over ranks."""

    def __init__(self, dp: DataParallel | None = None):
        self.dp, self.model = dp, None

    def place(self, model, ref_model, dtype: torch.dtype) -> None:
        """Take the policy (and the frozen reference model, or None) in ``dtype`` compute."""
        self.model = model

    def rows(self, batch: Batch) -> Batch:
        """This rank's rows of a minibatch (all of them on one device)."""
        return self.dp.shard(batch) if self.dp else batch

    def passes(self, micros: list, whole: Batch, micro_batches: Callable[[Batch], list]) -> Iterator:
        """The micro-batches this rank runs on its rows of the minibatch ``whole``."""
        yield from micros

    def sum_grads(self, params: list[torch.nn.Parameter]) -> None:
        if self.dp:
            self.dp.sum_grads(params)

    def sum_metrics(self, values: dict[str, float], *, maxima: tuple[str, ...] = ()) -> dict[str, float]:
        return self.dp.sum_metrics(values, maxima=maxima) if self.dp else values

    def gather(self) -> None:
        """After a step or a restore: the weights to publish are the model's own."""

    @property
    def publishable(self):
        """What a version and a checkpoint save: the model, or only its LoRA adapter."""
        return lora.AdapterView(self.model) if lora.is_peft(self.model) else self.model

    def optimizer_state(self, optimizer, params: list) -> dict:
        return optimizer.state_dict()

    def restore(self, path, meta, optimizer, params: list) -> None:
        """Load a checkpoint's weights, optimizer and RNG state."""
        checkpoint.restore(path, meta, model=self.model, optimizer=optimizer)


class Sharded(Plain):
    """FSDP2 (``trainer.fsdp``): ``fully_shard`` on every decoder layer and the root, so each
    rank holds 1/N of the weights, gradients and AdamW state. Every forward is a collective:
    every rank runs as many passes as the busiest one. Rank 0 holds the full weights gathered
    after each step (:attr:`full`) for the version writer; checkpoints gather the full state.
    Every method but :attr:`publishable` is called on every rank at the same point."""

    def __init__(self, dp: DataParallel):
        super().__init__(dp)
        self.full: dict[str, torch.Tensor] = {}  # rank 0: the full weights after the last step

    def place(self, model, ref_model, dtype: torch.dtype) -> None:
        if dtype == torch.float16:
            raise ConfigError("trainer.fsdp: train in bfloat16 or float32 (no fp16 loss scaling under FSDP)")
        gathered = None if dtype == torch.float32 else dtype  # layers gathered in the compute dtype
        for m in (model, ref_model):
            if m is not None:
                _shard(m, param_dtype=gathered)
        self.model = model

    def passes(self, micros: list, whole: Batch, micro_batches: Callable[[Batch], list]) -> Iterator:
        """Then None (a pass without rows) up to the busiest rank's count; gradients are
        reduce-scattered once, in the last pass."""
        shares = (whole.rows(torch.arange(r, whole.size, self.dp.world)) for r in range(self.dp.world))
        n = max(len(micro_batches(share)) if share.size else 0 for share in shares)
        for i in range(n):
            self.model.set_requires_gradient_sync(i == n - 1)
            yield micros[i] if i < len(micros) else None

    def sum_grads(self, params: list[torch.nn.Parameter]) -> None:
        """FSDP reduce-scattered the sums already."""

    def gather(self) -> None:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        full = get_model_state_dict(self.model, options=_options(cpu_offload=True))  # {} but on rank 0
        tied = weights.tied_keys(self.model)
        self.full = {k: v for k, v in full.items() if k not in tied}

    @property
    def publishable(self):
        """Rank 0's full weights: already a fresh CPU copy, which the version writer takes as is."""
        return weights.WeightsCopy(self.model, state=self.full)

    def optimizer_state(self, optimizer, params: list) -> dict:
        """The full AdamW state on rank 0 ({} elsewhere), keyed like ``optimizer.state_dict()``
        of one process (parameter indices), so checkpoints do not depend on the world size."""
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        sd = get_optimizer_state_dict(self.model, optimizer, options=_options(cpu_offload=True))
        if not sd:
            return {}
        index = {name: i for i, name in enumerate(_param_names(self.model, params))}
        groups = [{**g, "params": [index[n] for n in g["params"]]} for g in sd["param_groups"]]
        return {"state": {index[n]: v for n, v in sd["state"].items()}, "param_groups": groups}

    def restore(self, path, meta, optimizer, params: list) -> None:
        """Every rank takes its shards of the full (single-process) weights and optimizer state."""
        from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

        full, optimizer_state = checkpoint.read(path, meta, model=self.model)
        set_model_state_dict(self.model, full, options=_options(strict=False))  # tied copies: checked by read
        if optimizer_state:
            names = _param_names(self.model, params)
            sd = {
                "state": {names[int(i)]: v for i, v in optimizer_state["state"].items()},
                "param_groups": [
                    {**g, "params": [names[i] for i in g["params"]]} for g in optimizer_state["param_groups"]
                ],
            }
            set_optimizer_state_dict(self.model, optimizer, sd, options=_options())


def _shard(model, *, param_dtype: torch.dtype | None = None) -> None:
    """``fully_shard`` every decoder layer (the classes HF lists in ``_no_split_modules``),
    then the root; gradients reduce as sums (the learner's denominators are the minibatch's)."""
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    blocks = set(getattr(model, "_no_split_modules", None) or ())
    for module in list(model.modules()):
        if type(module).__name__ in blocks:
            fully_shard(module, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)  # a plain SUM (gloo has no PREMUL_SUM)


def _options(**kw):
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=True, **kw)


def _param_names(model, params: list) -> list[str]:
    """The names of ``params`` (the optimizer's, in its order)."""
    by_id = {id(p): n for n, p in model.named_parameters()}
    return [by_id[id(p)] for p in params]
