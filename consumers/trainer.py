"""`streamer train`: the trainer process — trajectory stream in, policy versions out.

Start: load the newest valid checkpoint (if any), publish its weights as a new policy
version (one past the newest on the policy stream: a version number is never reused),
publish the staleness limits for admission, and start the feed (consumers/feed.py, which
owns every trajectory entry's bookkeeping). Then, per step:

    ready = the next batch, fresh at hand-off (collated while the last step ran)
    learner.train_step(ready.batch)                 # consumers/learner.py
    feed.trained(ready)                             # admission slots back
    auditor.audit(ready.groups)                     # a few re-scored under their stamped versions
    version += 1; hand the weights to the version writer (lent on the CPU: the next step's
        optimizer waits until they are read; a snapshot on a GPU), which writes them and
        XADDs the WeightSync + SETs the version key in one script (consumers/versions.py)
    checkpoint_every steps after the last checkpoint (sooner when the trained but unacknowledged
        entries near half of bus.max_unacked): checkpoint, then the feed XACKs what it covers and trims
    publish the step's train metrics

A step whose every optimizer update was skipped (a non-finite gradient) changed no
weights: it is no step (no version, the step counter stays), its groups are dead-lettered
with the reason, and ``trainer.max_skipped_steps`` of them in a row stop the trainer with
one line naming the cause.

SIGTERM/SIGINT: the current step finishes, a final checkpoint covers what was trained,
exit 0. SIGUSR1 (`streamer up` sends it when its producers are done): every group that has
arrived is trained (the last ones in a smaller batch), then the same stop. A crash loses at
most the steps since the last checkpoint: their entries are still pending, so they are
trained again after the restart, exactly once into the persisted model.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading
import time
from functools import partial

import torch

from consumers import advantages, checkpoint, distributed, losses, resume
from consumers.audit import Auditor
from consumers.batch import collator
from consumers.distributed import DataParallel
from consumers.feed import Feeder, Ready
from consumers.filters import GroupFilter, unusable
from consumers.learner import Learner
from consumers.lineage import Lineage
from consumers.versions import VersionPublisher
from schemas import MetricsEvent
from schemas.metric_names import REJECT_REASONS, TOKENS_BEHIND
from streamer import lifecycle, position, problems, rundir
from streamer.admission import Admission
from streamer.bus import Publisher
from streamer.config import RunConfig
from streamer.connection import connect, retrying
from streamer.errors import StreamerError
from streamer.keys import ARCHIVE_GROUP, Keys
from streamer.trainer_lease import TrainerLease
from streamer.values import check_types

log = logging.getLogger(__name__)

CONSUMER_NAME = "trainer-0"  # one trainer per run: a stable name finds its pending entries again
STOP_SERVER_WAIT = 30.0  # seconds a stopping trainer waits for an unreachable server
MISMATCH_WARN_KL = 0.01  # k3 KL(sampler || trainer) on a fresh batch above which the engine is suspect


class Trainer:
    """The step loop around a :class:`Learner`; owns the stream, weights and checkpoints."""

    def __init__(
        self,
        cfg: RunConfig,
        client,
        keys: Keys,
        learner: Learner,
        *,
        stop: threading.Event,
        name: str = CONSUMER_NAME,
        group_filter: GroupFilter | None = None,
        dp: DataParallel | None = None,
        from_initial_weights: bool = False,
        lease: TrainerLease | None = None,
        finishing: threading.Event | None = None,
    ):
        self.cfg, self.trainer_cfg, self.client, self.keys = cfg, cfg.trainer, client, keys
        self.learner, self.stop, self.name = learner, stop, name
        self.finishing = finishing  # set: no more groups are coming; train what arrived, then stop
        self.finished = False  # stopped because every group that arrived was trained
        self.steps_skipped = self.skipped_in_a_row = 0  # steps that changed no weights
        self.failure = ""  # why the trainer must stop (too many skipped steps)
        self.dp = dp  # under torchrun: this is rank 0, the other ranks follow its batches
        # no checkpoint although the server records one: start from the initial weights anyway
        self.from_initial_weights = from_initial_weights
        self.group_filter = group_filter or GroupFilter.from_config(self.trainer_cfg)  # before any write
        self.lease = lease  # the run's trainer lease: every ack and version write checks its fence
        self.admission = Admission(
            client,
            keys,
            max_staleness=self.trainer_cfg.max_staleness,
            groups_per_step=self.trainer_cfg.groups_per_step,
            fence=lease,
        )
        self.version = 0
        self.parent: str | None = None  # the newest checkpoint
        self.checkpointed_version = -1
        self.checkpointed_step = 0  # the newest checkpoint's step (0: none yet)
        self.high_water = "0-0"  # the restored checkpoint's newest entry id trained into the model
        self.data_position: position.DataPosition | None = None  # the restored checkpoint's
        self.feed: Feeder | None = None
        self.lineage = Lineage()  # staleness along the version tree (consumers/lineage.py)
        self._mismatch_warned = False
        self.give_up_after: float | None = None  # server outage allowed to outputs; None = wait
        self.publisher = Publisher(client, keys, cfg.bus)
        self.versions = VersionPublisher(
            client,
            keys,
            root=cfg.weights_dir,
            keep_versions=self.trainer_cfg.keep_versions,
            protect=lambda: self.checkpointed_version,
            bus=cfg.bus,
            # in the dtype samplers load (float32 master weights, half-precision samplers)
            dtype=None if cfg.model.dtype == "float32" else getattr(torch, cfg.model.dtype),
            untie=cfg.untied_versions,
            fence=lease,
        )
        learner.before_update = self.versions.until_read  # the writer reads CPU weights in place
        self.auditor = Auditor.of(cfg, temperature=learner.temperature)  # version stamps, re-scored

    @property
    def step(self) -> int:
        return self.learner.step

    # ------------------------------------------------------------ start

    def start(self) -> None:
        check_types(self.client, self.keys.types())  # a key of the wrong type: one line, now
        self._restore()
        resume.check_server_state(self.client, self.keys, self.parent)
        if (queued := position.recover(self.client, self.keys, self.data_position)) is not None:
            log.warning(
                "the server lost the dataset position: restored from %s (cursor %d, %d open rows requeued)",
                self.parent,
                self.data_position.cursor,
                queued,
            )
        self.version = resume.next_version(
            self.client, self.keys, checkpointed=self.checkpointed_version, weights_dir=self.cfg.weights_dir
        )
        self.lineage = Lineage().load(resume.policy_history(self.client, self.keys))
        self.versions.publish_now(self.learner.publishable, version=self.version, step=self.step)
        self.lineage.add(self.version, self.step)
        self._state("running")
        problems.clear(self.client, self.keys, "trainer")  # what stopped a trainer before is history
        log.info("policy version %d at step %d (%s)", self.version, self.step, self.parent or "initial")
        tc = self.trainer_cfg
        self.admission.publish_limits(max_staleness=tc.max_staleness, groups_per_step=tc.groups_per_step)
        vocab = self.learner.model.get_input_embeddings().num_embeddings
        self.feed = Feeder(
            self.client,
            self.keys,
            name=self.name,
            bus=self.cfg.bus,
            admission=self.admission,
            group_filter=self.group_filter,
            groups_per_step=tc.groups_per_step,
            collate=collator(tc),
            version=lambda: self.version,
            validate=partial(unusable, vocab_size=vocab),
            staleness=self.lineage.staleness,
            trim_lag={ARCHIVE_GROUP: self.cfg.archive.max_lag},
            high_water=self.high_water,
            pin_memory=self.learner.device.type == "cuda",
            block_seconds=min(self.cfg.bus.block_seconds, 0.5),
            fence=self.lease,
        ).start()

    def _restore(self) -> None:
        found = checkpoint.latest(self.cfg.checkpoint_dir)
        if found is None and not self.from_initial_weights:  # another data dir, or deleted
            resume.refuse_a_lost_checkpoint(self.client, self.keys, self.cfg.checkpoint_dir)
        if self.dp:  # every rank restores the same checkpoint (the data dir is shared)
            self.dp.send_restore("" if found is None else str(found[0]))
        if found is None:
            log.info("no checkpoint in %s: starting from the initial weights", self.cfg.checkpoint_dir)
        else:
            path, meta = found
            self.learner.restore(path, meta)
            self.parent, self.high_water, self.checkpointed_version = meta.name, meta.high_water, meta.version
            self.checkpointed_step = meta.step
            self.data_position = meta.data
            log.info("restored checkpoint %s (step %d, high-water %s)", meta.name, meta.step, meta.high_water)
        self.learner.gather()  # sharded: the weights publish_now writes

    def _state(self, state: str) -> None:
        """``running`` / ``stopped`` in the run marker, for `streamer status`."""
        self.client.hset(self.keys.run_marker, "trainer", state)

    # ------------------------------------------------------------ the loop

    def run(self) -> int:
        try:
            retrying(self.start, what="starting the trainer")  # a restart mid-start: again, a new version
            try:
                for ready in self.feed.batches(
                    until=lambda: (
                        self.stop.is_set()
                        or self._done()
                        or self._fenced()
                        or bool(self.failure)
                        or self._finished()
                    )
                ):
                    self._step(ready)
            finally:
                if self.feed is not None:
                    self.feed.stop()
                if self.dp:
                    self.dp.send_stop()
            if self._fenced():  # another trainer has the run: no final checkpoint, no ack
                raise self.lease.fenced()
            # stopping: a server that went away with us (our supervisor died) is not waited
            # for forever; the checkpoint on disk is the resume point whether acks land or not
            self.versions.give_up_after = self.give_up_after = STOP_SERVER_WAIT
            if self.feed.uncovered:
                self.checkpoint()
            self.versions.close()
            retrying(lambda: self._state("stopped"), what="marking the run", give_up_after=self.give_up_after)
        except BaseException:
            self.versions.abandon()
            raise
        if summary := self.auditor.summary():
            log.info("%s", summary)
        if self.failure:
            problems.report(self.client, self.keys, "trainer", self.failure)
            raise StreamerError(self.failure)
        if self.finished:
            log.info("the producers are done and every group that arrived is trained or set aside")
        log.info("stopped at step %d, version %d", self.step, self.version)
        return 0

    def _fenced(self) -> bool:
        return self.lease is not None and self.lease.lost.is_set()

    def _done(self) -> bool:
        return self.trainer_cfg.steps > 0 and self.step >= self.trainer_cfg.steps

    def _finished(self) -> bool:
        """Told that no more groups are coming, and every one that came is handed out."""
        if self.finishing is None or not self.finishing.is_set():
            return False
        if not self.feed.finishing:
            log.info("no more groups are coming: training every group that arrived, then stopping")
        self.feed.finish()
        self.finished = self.feed.drained()
        return self.finished

    def _step(self, ready: Ready) -> None:
        """Train one batch, publish the next version, checkpoint when due, report."""
        lags = [self.lineage.staleness(g) for g in ready.groups]
        behind = self.lineage.tokens_behind(ready.groups)
        t0 = time.monotonic()
        if self.dp:
            self.dp.send_batch(ready.batch)
        before = self.learner.step
        stats = self.learner.train_step(ready.batch)
        if self.learner.step == before:  # every update skipped: no weights changed
            self._skipped(ready, stats)
            return
        self.skipped_in_a_row = 0
        step_seconds = time.monotonic() - t0
        self.feed.trained(ready)
        audited = self.auditor.audit(ready.groups, step=self.step)
        self.version += 1
        self.lineage.add(self.version, self.step)
        blocked = self.versions.submit(self.learner.publishable, version=self.version, step=self.step)
        # Trained entries stay unacknowledged until a checkpoint covers them, and producers
        # wait while bus.max_unacked entries are: checkpoint early rather than deadlock.
        early = self.feed.uncovered + self.trainer_cfg.groups_per_step > self.cfg.bus.max_unacked // 2
        if self.step - self.checkpointed_step >= self.trainer_cfg.checkpoint_every or early:
            self.checkpoint()
        rewards = [r for g in ready.groups for r in g.episode_rewards().tolist()]
        lengths = [s.completion_len for g in ready.groups for s in g.samples]
        values = {
            **stats,
            "tokens_per_second": stats["tokens"] / max(step_seconds, 1e-9),
            "step_seconds": step_seconds,
            "data_wait_seconds": ready.waited,
            "staleness_mean": sum(lags) / len(lags),
            "staleness_max": float(max(lags)),
            "reward_mean": sum(rewards) / len(rewards),
            "response_length_mean": sum(lengths) / len(lengths),
            "response_length_max": float(max(lengths)),
            "version": float(self.version),
            "weight_sync_seconds": self.versions.last_seconds,
            "groups_accepted": float(len(ready.groups)),
            "steps_skipped": 0.0,
            "groups_skipped": 0.0,
            **audited,
            **{f"tokens_behind_{k}": float(behind.get(int(k), 0)) for k in TOKENS_BEHIND[:-1]},
            "tokens_behind_3_or_more": float(sum(n for d, n in behind.items() if d >= 3)),
        }
        rejected = self.feed.take_rejections()
        values.update({f"groups_rejected_{r}": float(rejected.get(r, 0)) for r in REJECT_REASONS})
        self._check_mismatch(values)
        self._publish_metrics(values)
        log.info(
            "step %d v%d loss %.4f reward %.3f staleness %.1f rejected %d "
            "step %.2fs wait %.2fs sync %.2fs (blocked %.2fs)",
            self.step,
            self.version,
            stats["loss"],
            values["reward_mean"],
            values["staleness_mean"],
            sum(rejected.values()),
            step_seconds,
            ready.waited,
            self.versions.last_seconds,
            blocked,
        )

    def _skipped(self, ready: Ready, stats: dict[str, float]) -> None:
        """A step whose every update was skipped: its groups are not trained (dead letters),
        it is counted, and too many in a row stop the trainer."""
        self.steps_skipped += 1
        self.skipped_in_a_row += 1
        why = f"the gradient was not finite (loss {stats['loss']:.4g}, grad norm {stats['grad_norm']:.4g})"
        self.feed.dead_letter(ready, f"trainer step skipped: {why}")
        retrying(
            lambda: self.client.hincrby(self.keys.run_marker, "steps_skipped", 1),
            what="counting a skipped step",
        )
        counts = {"steps_skipped": 1.0, "groups_skipped": float(len(ready.groups))}
        counts["optimizer_steps_skipped"] = stats["optimizer_steps_skipped"]
        self._publish_metrics(counts)
        log.warning(
            "step skipped (%d in a row, %d in all): %s; its %d groups are dead letters, no weights changed",
            self.skipped_in_a_row,
            self.steps_skipped,
            why,
            len(ready.groups),
        )
        limit = self.trainer_cfg.max_skipped_steps
        if limit and self.skipped_in_a_row >= limit:
            self.failure = (
                f"{self.skipped_in_a_row} trainer steps in a row were skipped (trainer.max_skipped_steps = "
                f"{limit}): {why}, so no weights changed after step {self.step}. Check trainer.loss, "
                "trainer.lr and model.dtype; `streamer dead --replay` sends the skipped groups again"
            )

    # ------------------------------------------------------------ outputs

    def _check_mismatch(self, values: dict[str, float]) -> None:
        """Warn once when the samplers' log-probs disagree with the trainer's on a batch that
        is all fresh (staleness 0): then mismatch_kl measures the engine, not the lag."""
        kl = values.get("mismatch_kl", 0.0)
        if self._mismatch_warned or values["staleness_max"] > 0 or not kl > MISMATCH_WARN_KL:
            return
        self._mismatch_warned = True
        log.warning(
            "the samplers' log-probs disagree with the trainer's on fresh data: mismatch_kl %.3g at step %d "
            "(> %g). Check producer.engine and producer.remote_logprobs against the server, model.dtype, "
            "and that a vLLM server serves an untied model (docs/ENGINES.md)",
            kl,
            self.step,
            MISMATCH_WARN_KL,
        )

    def _publish_metrics(self, values: dict[str, float]) -> None:
        event = MetricsEvent(axis="train", step=self.step, values=values, source="trainer")
        retrying(lambda: self.publisher.publish(self.keys.metrics, event), what="publishing metrics")

    def _cursor_check(self) -> None:
        """The cursor never goes back: one behind the last checkpoint's (deleted, overwritten)
        would hand out rows again that were trained. Put it forward, and say so."""
        saved = self.data_position
        try:
            behind = position.lost(self.client, self.keys, saved)
        except ValueError:  # not a number: the producers' claims name it
            return
        if behind:
            log.warning(
                "the dataset cursor %s is behind the last checkpoint's (%d): deleted or overwritten; "
                "put forward again (rows from it were handed out already)",
                self.keys.cursor,
                saved.cursor,
            )
            position.restore(self.client, self.keys, position.DataPosition(cursor=saved.cursor))

    def checkpoint(self) -> None:
        """Persist what was trained, then acknowledge the entries it covers."""
        self.versions.drain()  # its version is published before a checkpoint names it
        covered = self.feed.covered()
        retrying(self._cursor_check, what="checking the dataset cursor", give_up_after=self.give_up_after)
        data = position.read(self.client, self.keys, give_up_after=self.give_up_after)
        if self.dp:  # every rank takes part in gathering the optimizer state (sharded)
            self.dp.send_checkpoint()
        meta = checkpoint.save(
            self.cfg.checkpoint_dir,
            model=self.learner.publishable,
            optimizer_state=self.learner.optimizer_state(),
            step=self.step,
            version=self.version,
            parent=self.parent,
            covered=covered,
            data=data,
        )
        self.parent, self.checkpointed_version, self.checkpointed_step = meta.name, meta.version, meta.step
        self.data_position = data or self.data_position
        self.feed.checkpointed(covered, give_up_after=self.give_up_after)
        retrying(  # a trainer that finds no checkpoint knows whether the run has one
            lambda: resume.record_checkpoint(self.client, self.keys, meta.name),
            what="recording the checkpoint",
            give_up_after=self.give_up_after,
        )
        checkpoint.prune(self.cfg.checkpoint_dir, self.trainer_cfg.keep_checkpoints)
        n = len(covered.entry_ids)
        log.info("checkpoint %s covers %d groups (high-water %s)", meta.name, n, meta.high_water)


# ---------------------------------------------------------------- the process


def main(cfg: RunConfig, args: argparse.Namespace | None = None) -> int:
    """`streamer train`: run until trainer.steps (0 = forever) or SIGTERM/SIGINT; 0 when stopped."""
    nproc = getattr(args, "nproc", 1) or 1
    if nproc > 1 and distributed.world()[1] == 1:  # `--nproc N` outside torchrun: start it
        distributed.launch(nproc, distributed.without_nproc(sys.argv[1:]))
    stop, finishing = threading.Event(), lifecycle.finish_requested
    doing = "finishing the current step, then a final checkpoint"
    previous = lifecycle.on_stop_signals(stop, "trainer", doing, orphan_grace=lifecycle.TRAINER_ORPHAN_GRACE)
    # `up`, when its producers are done: train every group that arrived, then stop (a signal
    # that came before this line was kept by streamer.__main__)
    finish_handler = signal.signal(signal.SIGUSR1, lambda *_: finishing.set())
    _quiet_transformers()
    dp: DataParallel | None = None
    try:
        url = cfg.require_redis_url()
        group_filter = GroupFilter.from_config(cfg.trainer)  # a bad user_filter: before anything runs
        losses.resolve(cfg.trainer.loss)  # and a bad loss import path
        advantages.check_group_size(
            advantages.resolve(cfg.trainer),
            group_size=cfg.producer.group_size,
            min_group_size=cfg.trainer.min_group_size,
        )
        dp = DataParallel.init(sharded=cfg.trainer.fsdp)  # under torchrun; rank 0 trains, the others follow
        if dp is not None and dp.rank > 0:
            dp.leave(distributed.follow(Learner.from_config(cfg, dp), dp))  # a follower writes nothing
        client = connect(url, socket_timeout=cfg.bus.socket_timeout, name="streamer-trainer")
        keys = Keys(cfg.run.name)
        # one trainer per run: a second one would prune the first one's files (one line, exit 1)
        lock = rundir.trainer_lock(rundir.mark_run(cfg.run_dir)).acquire()
        # ... and on the server: one with another data dir is refused too (streamer.trainer_lease)
        lease = TrainerLease.of_run_dir(client, keys, cfg.run_dir)
        try:
            retrying(lease.acquire, what="taking the run's trainer lease")
            lease.start_renewing()
            learner = Learner.from_config(cfg, dp)
            log.info("trainer for run %s on %s", cfg.run.name, learner.device)
            trainer = Trainer(
                cfg,
                client,
                keys,
                learner,
                stop=stop,
                group_filter=group_filter,
                dp=dp,
                from_initial_weights=getattr(args, "from_initial_weights", False),
                lease=lease,
                finishing=finishing,
            )
            code = trainer.run()
            if dp is not None:  # the followers were told to stop: leave together
                dp.close(clean=True)
            return code
        finally:
            lease.give_back()
            lock.release()
    finally:
        lifecycle.restore_signals({**previous, signal.SIGUSR1: finish_handler})
        if dp is not None:
            dp.close()


def _quiet_transformers() -> None:
    """No progress bars in a long-running process's log (one per saved version otherwise)."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
