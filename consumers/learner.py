"""The trainer step: model + optimizer + one batch -> updated weights and step metrics.

No Redis, no files but the models it loads (:meth:`Learner.from_config`): the trainer
process hands it :class:`~consumers.batch.Batch` objects. One trainer step (the objective:
consumers/losses/) is ``ppo_minibatches`` optimizer steps:

1. recompute the proximal log-probs of the whole batch once, without grad (and the frozen
   reference model's, when ``kl_coef > 0``), plus the policy entropy as a metric, all at
   the sampler's temperature. The first minibatch's are its own update's forward, detached:
   no weight has changed before it, and where the model has no dropout in training (a LoRA
   adapter's ``dropout`` is the exception) that forward is the proximal policy's, so the
   pass is skipped;
2. split the batch into ``ppo_minibatches`` row slices; for each, accumulate gradients
   over micro-batches of ``micro_batch_size`` rows, or of rows bucketed by length up to
   ``micro_batch_tokens`` tokens (packed without padding where the attention allows it:
   :meth:`Learner.packs`), each normalised by the whole minibatch's denominator,
   clip the global grad norm, set the scheduled LR (consumers/schedule.py) and take one
   AdamW update (skipped if the gradient is not finite: consumers/precision.py).

Under torchrun every rank runs this same step on its rows of each minibatch, with the whole
minibatch's denominators and gradients and metrics summed over ranks: the single-device step
(consumers/distributed.py). Whether the weights are whole on each rank or sharded (FSDP2) is
one strategy object chosen at construction (consumers/strategy.py).
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable

import torch

from consumers import losses, precision, schedule, strategy
from consumers.batch import Batch, Packed, pack
from consumers.distributed import DataParallel
from streamer import lora, models
from streamer.config import RunConfig, TrainerSection

log = logging.getLogger(__name__)

BETAS = (0.9, 0.999)


class Learner:
    def __init__(
        self,
        model,
        cfg: TrainerSection,
        *,
        ref_model=None,
        step: int = 0,
        temperature: float = 1.0,
        dp: DataParallel | None = None,
    ):
        """``temperature``: the samplers' (``producer.temperature``; 0 = greedy = 1 here). The
        proximal, current and reference log-probs are all of ``softmax(logits / temperature)``,
        the distribution the sampler reported its log-probs under, so on fresh data the
        importance weight is exactly 1 and it measures staleness and engine mismatch only.
        """
        if cfg.kl_coef > 0 and ref_model is None:
            raise ValueError("kl_coef > 0 needs a reference model")
        if temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {temperature}")
        self.model, self.cfg, self.ref_model, self.step = model, cfg, ref_model, step
        self.temperature = temperature if temperature > 0 else 1.0
        self.phases = dict.fromkeys(PHASES, 0.0)  # seconds per phase of the current trainer step
        # called before each optimizer step changes the weights: the version writer may be
        # reading them in place (consumers/versions.py)
        self.before_update: Callable[[], None] = lambda: None
        self.device = next(model.parameters()).device
        loaded = precision.to_master(model)  # fp32 weights and AdamW state, whatever model.dtype is
        dtype = precision.compute_dtype(cfg.precision, device=self.device, loaded=loaded)
        self.precision = precision.Precision(dtype, self.device)
        _disable_dropout(model)
        # the first minibatch's update forward is its proximal one (see the module's docstring)
        self.prox_from_update = not _stochastic_in_training(model)
        if cfg.gradient_checkpointing:  # transformers 5 renamed it; 4.x has only the old name
            enable = getattr(model, "activation_checkpointing_enable", None)
            (enable or model.gradient_checkpointing_enable)()
            model.config.use_cache = False
        if ref_model is not None:
            ref_model.eval().requires_grad_(False)
        self.strategy = strategy.choose(dp)  # one device, replicated or sharded (FSDP2)
        self.strategy.place(model, ref_model, dtype)
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.objective = losses.Objective.of(cfg)
        self.packing = cfg.micro_batch_tokens > 0 and self.packs(model)
        if cfg.micro_batch_tokens > 0:
            how = "packed without padding" if self.packing else "bucketed by length, padded (no packing)"
            log.info("micro-batches of up to %d tokens, %s", cfg.micro_batch_tokens, how)
        # foreach: one op per update over every tensor (torch's own choice on a GPU; on a CPU it
        # loops tensor by tensor, ~0.5 ms more a step of the demo), with the same results
        self.optimizer = torch.optim.AdamW(
            self.params, lr=cfg.lr, betas=BETAS, weight_decay=cfg.weight_decay, foreach=True
        )

    @classmethod
    def from_config(cls, cfg: RunConfig, dp: DataParallel | None = None) -> Learner:
        """The policy (and frozen reference) from the model config, seeded by run.seed."""
        random.seed(cfg.run.seed)
        torch.manual_seed(cfg.run.seed)
        dev = dp.device if dp else None  # under torchrun: this rank's device
        model = models.load_model(cfg.model, seed=cfg.run.seed, dev=dev)
        if cfg.model.lora.rank > 0:
            model = lora.apply(model, cfg.model.lora)  # the base frozen: the adapter is trained and published
        ref = models.load_model(cfg.model, seed=cfg.run.seed, dev=dev) if cfg.trainer.kl_coef > 0 else None
        if cfg.producer.top_p < 1:
            log.warning(
                "producer.top_p = %s: samplers report nucleus-renormalised log-probs, the trainer full-softmax "
                "ones, so every importance weight is the nucleus mass (< 1); see producers/samplers.py",
                cfg.producer.top_p,
            )
        return cls(model, cfg.trainer, ref_model=ref, temperature=cfg.producer.temperature, dp=dp)

    @property
    def publishable(self):
        """What a version and a checkpoint save: the model, only its LoRA adapter, or (sharded,
        rank 0) the full weights gathered after the last step."""
        return self.strategy.publishable

    def gather(self) -> None:
        """Sharded: gather the full weights onto rank 0 (every rank calls it at the same point)."""
        self.strategy.gather()

    def optimizer_state(self) -> dict:
        """The optimizer's state dict as one process has it (sharded: a collective gather,
        every rank calls it; {} except on rank 0)."""
        return self.strategy.optimizer_state(self.optimizer, self.params)

    def restore(self, path, meta) -> None:
        """Load a checkpoint's weights, optimizer and RNG state (every rank, when sharded)."""
        self.strategy.restore(path, meta, self.optimizer, self.params)
        self.step = meta.step

    def lr_at(self, step: int) -> float:
        """LR of optimizer step ``step`` (0-based; see consumers/schedule.py)."""
        return schedule.lr_at(self.cfg, step)

    def forward_logits(self, model, mb: Batch) -> torch.Tensor:
        """(b, T-1, V) next-token logits of ``mb``'s inputs."""
        with self.precision.autocast():
            out = model(input_ids=mb.input_ids, attention_mask=mb.attention_mask, use_cache=False)
        return out.logits[:, :-1]

    @torch.no_grad()
    def packs(self, model) -> bool:
        """Whether ``model`` keeps packed rows apart: two short sequences end to end, with
        position ids restarting at 0 and no attention mask, must give each one's own logits
        (transformers' sdpa/eager masks and flash-attention's varlen do; a model that ignores
        the position ids in its mask, or does not take them, is trained bucketed and padded)."""
        ids = torch.arange(2, 14, device=self.device).remainder(model.config.vocab_size).unsqueeze(0)
        a, b = ids[:, :7], ids[:, 7:]
        positions = torch.cat([torch.arange(7), torch.arange(5)]).unsqueeze(0).to(self.device)
        training = model.training
        model.eval()
        try:
            with self.precision.autocast():
                apart = [model(input_ids=x, use_cache=False).logits.float() for x in (a, b)]
                both = model(input_ids=ids, position_ids=positions, use_cache=False).logits.float()
        except (TypeError, ValueError, RuntimeError) as e:
            log.info("packing not supported by this model (%s)", e)
            return False
        finally:
            model.train(training)
        tol = 1e-3 if self.precision.dtype == torch.float32 else 5e-2
        scale = max(float(torch.cat(apart, 1).abs().max()), 1.0)
        return float((torch.cat(apart, 1) - both).abs().max()) <= tol * scale

    def micro_batches(self, batch: Batch) -> list[torch.Tensor]:
        """Row indices of ``batch``'s micro-batches (see :meth:`Batch.micro_batches`)."""
        cfg = self.cfg
        return batch.micro_batches(
            rows=cfg.micro_batch_size, tokens=cfg.micro_batch_tokens, packed=self.packing
        )

    def token_logprobs(self, model, mb: Batch, *, entropy: bool = False) -> tuple[torch.Tensor, float]:
        """``mb``'s (b, T-1) target log-probs under ``model`` (packed or padded), and with
        ``entropy`` the policy entropy summed over its trained tokens, weighted (else 0)."""
        p: Packed | None = pack(mb) if self.packing else None
        if p is None:
            logits, targets, weights = self.forward_logits(model, mb), mb.targets, mb.weights
        else:
            with self.precision.autocast():
                out = model(input_ids=p.input_ids, position_ids=p.position_ids, use_cache=False)
            logits, targets, weights = out.logits[:, :-1], p.targets, p.pack(mb.weights)  # (1, L-1, ...)
        logp = losses.token_logprobs(logits, targets, self.temperature)
        ent_sum = 0.0
        if entropy:
            trained = weights > 0
            with torch.no_grad():  # a metric: no graph, in an update's forward too
                ent = losses.token_entropy(logits[trained].detach(), self.temperature)
                ent_sum = float((ent * weights[trained]).sum())
        return (logp if p is None else p.unpack(logp)), ent_sum

    def _idle(self, whole: Batch, *, backward: bool, proximal: bool = True) -> None:
        """A pass with no rows of this rank's (one row of ``whole``, zero loss), so
        that its collectives match the other ranks'."""
        row = whole.rows(slice(0, 1))
        models = (self.model,) if backward else (self.model if proximal else None, self.ref_model)
        for model in models:
            if model is not None:
                logits = self.forward_logits(model, row)
                if backward:
                    (logits.float().sum() * 0.0).backward()

    @torch.no_grad()
    def prepare(
        self, batch: Batch, whole: Batch | None = None, *, proximal: bool = True
    ) -> tuple[Batch, float]:
        """Fill ``prox_logp`` (and ``ref_logp``); returns the batch and its summed weighted entropy.

        ``whole``: the minibatch ``batch`` is this rank's share of (sharded ranks pad passes).
        Without ``proximal`` only ``ref_logp`` is filled (its update fills ``prox_logp``)."""
        whole = batch if whole is None else whole
        if not proximal and self.ref_model is None:
            return batch, 0.0
        micros = self.micro_batches(batch) if batch.size else []
        training = self.model.training
        self.model.eval()  # no adapter dropout in the proximal policy
        # (B, T-1); micro-batches may take rows in any order
        prox = torch.zeros_like(batch.weights) if proximal else None
        ref = torch.zeros_like(batch.weights) if self.ref_model is not None else None
        ent_sum = 0.0
        for rows in self.strategy.passes(micros, whole, self.micro_batches):
            if rows is None:  # a data-parallel rank short of rows
                self._idle(whole, backward=False, proximal=proximal)
                continue
            mb = batch.rows(rows)
            t0 = self._clock()
            if proximal:
                logp, ent = self.token_logprobs(self.model, mb, entropy=True)
                prox[rows] = _pad(logp, prox.shape[1])
                ent_sum += ent
            t1 = self._clock()
            self.phases["proximal_forward_seconds"] += t1 - t0
            if ref is not None:
                ref[rows] = _pad(self.token_logprobs(self.ref_model, mb)[0], ref.shape[1])
                self.phases["reference_forward_seconds"] += self._clock() - t1
        self.model.train(training)
        if batch.size == 0:  # a data-parallel rank's share of a small minibatch
            return batch, 0.0
        return batch.replace(prox_logp=prox, ref_logp=ref), ent_sum

    def train_step(self, batch: Batch) -> dict[str, float]:
        """One trainer step on ``batch`` (``ppo_minibatches`` optimizer steps); returns its metrics."""
        self.model.train()
        self.phases = dict.fromkeys(PHASES, 0.0)
        batch = batch.to(self.device, non_blocking=True)
        minibatches = batch.split(self.cfg.ppo_minibatches)
        # every proximal log-prob before the first update; a rank prepares only its own rows
        mine, entropy = [], 0.0
        for i, mb in enumerate(minibatches):
            prepared, ent = self.prepare(
                self.strategy.rows(mb), mb, proximal=i > 0 or not self.prox_from_update
            )
            mine.append(prepared)
            entropy += ent
        totals: dict[str, float] = {}
        for i, (mb, local) in enumerate(zip(minibatches, mine)):
            lr = self.lr_at(self.step * self.cfg.ppo_minibatches + i)  # counted in optimizer steps
            for group in self.optimizer.param_groups:
                group["lr"] = lr
            out, ent = self._update(local, whole=mb)
            entropy += ent
            for k, v in out.items():
                totals[k] = max(totals.get(k, 0.0), v) if k == "is_weight_max" else totals.get(k, 0.0) + v
        entropy = self.strategy.sum_metrics({"e": entropy})["e"] / max(float(batch.weights.sum()), 1e-8)
        n = len(minibatches)
        if totals.get("optimizer_steps_skipped", 0.0) < n:  # else no weights changed: no step
            self.step += 1
        self.gather()
        kept = ("is_weight_max", "optimizer_steps_skipped")  # a max and a count, not means
        metrics = {k: (v if k in kept else v / n) for k, v in totals.items()}
        metrics.update(entropy=entropy, lr=lr, tokens=float(batch.num_tokens), **self.phases)
        return metrics

    def _clock(self) -> float:
        """monotonic seconds, after the device's queued work (phase times on a GPU are real)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.monotonic()

    def _update(self, mb: Batch, *, whole: Batch) -> tuple[dict[str, float], float]:
        """Accumulate the minibatch's gradient over micro-batches, clip, step; its metrics,
        and the summed weighted entropy of its rows where its forward was their proximal one.

        ``mb`` is this rank's rows of the minibatch ``whole`` (all of it on one device); the
        loss is normalised by ``whole``'s denominator, so per-rank gradients add up exactly.
        ``mb`` without ``prox_logp``: each micro-batch's own forward, detached, is it.
        """
        cfg = self.cfg
        self.optimizer.zero_grad(set_to_none=True)
        denom = self.objective.normalizer(whole.weights)
        n_tok = max(float((whole.weights > 0).sum()), 1.0)
        out = {"loss": 0.0, "is_weight_max": 0.0}
        proximal, ent_sum = mb.prox_logp is None, 0.0
        t0 = self._clock()
        micros = [mb.rows(rows) for rows in self.micro_batches(mb)] if mb.size else []
        for micro in self.strategy.passes(micros, whole, self.micro_batches):
            if micro is None:  # a data-parallel rank short of rows
                self._idle(whole, backward=True)
                continue
            logp, ent = self.token_logprobs(self.model, micro, entropy=proximal)
            if proximal:
                micro, ent_sum = micro.replace(prox_logp=logp.detach()), ent_sum + ent
            loss, stats = self.objective(logp, micro, denom=denom)
            self.precision.backward(loss)
            share = float((micro.weights > 0).sum()) / n_tok  # token share of this micro-batch
            out["loss"] += loss.item()
            for k, v in stats.items():
                if k == "is_weight_max":
                    out[k] = max(out[k], float(v))
                else:  # aggregated terms sum over micro-batches; token means weigh by share
                    out[k] = out.get(k, 0.0) + float(v) * (1.0 if k in _SUMMED else share)
        self.strategy.sum_grads(self.params)  # over ranks: the single-device gradient (and metrics)
        out = self.strategy.sum_metrics(out, maxima=("is_weight_max",))
        t1 = self._clock()
        self.before_update()
        out["grad_norm"], skipped = self.precision.step(self.optimizer, self.params, cfg.grad_clip)
        out["optimizer_steps_skipped"] = float(skipped)
        self.phases["forward_backward_seconds"] += t1 - t0
        self.phases["optimizer_seconds"] += self._clock() - t1
        return out, ent_sum


PHASES = (
    "proximal_forward_seconds",
    "reference_forward_seconds",
    "forward_backward_seconds",
    "optimizer_seconds",
)
_SUMMED = ("policy_loss", "kl")  # aggregated with the minibatch's shared denominator


def _disable_dropout(model) -> None:
    """RL updates run without dropout: then prox == logp on fresh data (exact on-policy GRPO).

    A LoRA adapter's dropout (``model.lora.dropout``) is the exception the user asked for:
    it stays on in the updates (the proximal pass runs in eval mode, without it).
    """
    for name, m in model.named_modules():
        if "lora_dropout" in name:
            continue
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0
        if isinstance(getattr(m, "attention_dropout", None), float):
            m.attention_dropout = 0.0


def _stochastic_in_training(model) -> bool:
    """Whether ``model`` computes otherwise in training mode than in eval mode: a dropout
    left on (a LoRA adapter's), or a router's jitter noise (Mixtral-like mixtures of experts)."""
    for m in model.modules():
        if isinstance(m, torch.nn.Dropout) and m.p > 0:
            return True
        if any(float(getattr(m, name, 0.0) or 0.0) > 0 for name in ("jitter_noise", "router_jitter_noise")):
            return True
    return False


def _pad(t: torch.Tensor, width: int) -> torch.Tensor:
    """Right-pad (b, w) to (b, width) with zeros (micro-batches are trimmed to their own width)."""
    return torch.nn.functional.pad(t, (0, width - t.shape[1])) if t.shape[1] < width else t
