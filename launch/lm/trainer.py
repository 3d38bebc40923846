"""The reference job as a trainer: ``setup`` (model, optimizer, scaler, data, resume), ``step``
(one optimizer step and its metrics line), ``finish`` (checkpoint, evaluation, the ranks'
agreement, summary, plot); ``run`` does all three with a progress bar."""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import random
import socket
import statistics
import time
from contextlib import nullcontext
from pathlib import Path
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch.distributed.tensor.debug import CommDebugMode
from tqdm import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm

from common.distributed import Dist, gather_objects
from common.probes import PhaseTimer
from distscaler import GradScaler
from lm.agreement import RankView, params_digests, ranks_agree
from lm.checkpoint import CKPT_NAME, load_checkpoint, save_checkpoint
from lm.config import TrainConfig
from lm.data import get_batch, load_corpus
from lm.evaluate import evaluate
from lm.faults import flip_sign_bit_, inject_inf_
from lm.layout import Parallel
from lm.metrics import (
    METRICS_NAME,
    SUMMARY_NAME,
    MetricsLog,
    step_record,
    summarize,
    write_summary,
)
from lm.optim import lr_at, make_optimizer
from lm.parallel import build_parallel
from lm.plot import PLOT_NAME, plot_metrics

__all__ = ["Resume", "Trainer", "train_step"]

logger = logging.getLogger(__name__)

#: ``--resume``: "always" needs a checkpoint in ``--out``; "auto" resumes from one if there is
#: one and starts fresh otherwise (what a job restarted by torchrun's ``--max-restarts`` wants).
Resume = Literal["always", "auto"]


def train_step(
    par: Parallel,
    optimizer: torch.optim.Optimizer,
    scaler: GradScaler,
    x: torch.Tensor,
    y: torch.Tensor,
    cfg: TrainConfig,
    *,
    inject: bool = False,
    bitflip: bool = False,
    timer: PhaseTimer | None = None,
    comm: CommDebugMode | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One optimizer step; returns the loss and the global unscaled gradient norm, on the device.

    No host read here: with a fused optimizer the scaler's skip decision and clipping stay on the
    device. ``inject``: write an inf into this rank's first gradient after backward; ``bitflip``:
    flip the sign bit of one of its gradient elements (silent data corruption). ``timer`` and
    ``comm`` (CommDebugMode) cover the scaler phase: clip_grad_norm_ + step + update.
    """
    loss = par.forward_backward(x, y, optimizer, scaler, cfg)
    if inject:
        # After backward the gradients are already reduced (DDP, FSDP): only this rank sees it.
        inject_inf_(par.state_module)
    if bitflip:
        where = flip_sign_bit_(par.state_module)
        logger.warning("inject_bitflip: flipped the sign bit of %s on this rank", where)
    if timer is not None:
        timer.start()
    with comm if comm is not None else nullcontext():
        # One collective gives every rank the same skip decision and the same global norm.
        grad_norm = scaler.clip_grad_norm_(optimizer, cfg.max_norm)
        scaler.step(optimizer)
        scaler.update()
    if timer is not None:
        timer.stop()
    return loss, grad_norm


class Trainer:
    """The job on an initialized :class:`~common.distributed.Dist`; every rank runs the same calls.

    ``resume``: None starts fresh (``metrics.jsonl`` is rewritten), "always" continues from
    ``--out``'s checkpoint (an error if there is none), "auto" continues from it if it exists.
    """

    def __init__(
        self,
        cfg: TrainConfig,
        d: Dist,
        *,
        config_path: str | Path | None = None,
        resume: Resume | None = None,
        t_start: float | None = None,
        inject_bitflip: tuple[int, int] | None = None,
    ) -> None:
        self.cfg, self.d = cfg, d
        #: ``--inject-bitflip STEP:RANK``: flip a gradient bit on RANK after the reduce at STEP.
        self.inject_bitflip = inject_bitflip
        #: The steps a replica mismatch skipped, with the ranks named (the same on every rank).
        self.replica_mismatches: list[dict[str, Any]] = []
        self._last_mismatch: Any = None
        self.config_path = config_path
        self.resume = resume
        self.t_start = time.perf_counter() if t_start is None else t_start
        self.out = Path(cfg.out)
        self.ckpt_path = self.out / CKPT_NAME
        self.start_step = 0
        self.last_step = 0
        self.resumed_from: dict[str, Any] | None = None
        self.metrics: MetricsLog | None = None
        self.skipped_steps: list[int] = []  # this rank's view, checked against the others
        self.scaler_times: list[float] = []
        self.comm_counts: dict[str, int] = {}
        self.train_time = 0.0

    # ------------------------------------------------------------------------------- setup

    def setup(self) -> None:
        """Data, model, optimizer and scaler; the checkpoint when resuming; ``metrics.jsonl``."""
        cfg, d = self.cfg, self.d
        if d.device.type == "cpu":
            threads = cfg.num_threads or max(1, len(os.sched_getaffinity(0)) // d.local_world_size)
            torch.set_num_threads(threads)
        self.out.mkdir(parents=True, exist_ok=True)
        self.train_data, self.held_out, num_files = load_corpus(cfg)
        logger.info("config %s: %s", self.config_path or "(built-in)", dataclasses.asdict(cfg))
        logger.info(
            "world_size=%d device=%s backend=%s threads/rank=%d data: %d files, %.2f MB train, "
            "%.2f MB held out",
            d.world_size,
            d.device,
            dist.get_backend() if d.enabled else "none",
            torch.get_num_threads(),
            num_files,
            len(self.train_data) / 1e6,
            len(self.held_out) / 1e6,
        )
        # The same initial model on every rank, laid out as cfg.parallelism (lm.parallel).
        self.par = build_parallel(cfg, d)
        # The ranks of one data-parallel replica (a TP group, a pipeline) draw the same batches.
        random.seed(cfg.seed + self.par.dp_rank)
        self.sampler = torch.Generator().manual_seed(cfg.seed + self.par.dp_rank)
        logger.info("parallelism %s: %s", cfg.parallelism, self.par.describe)
        logger.info("model: %.2fM parameters", self.par.num_params / 1e6)
        self.optimizer = make_optimizer(self.par.state_module, cfg, d.device)
        scaler_config = cfg.scaler if cfg.amp else dataclasses.replace(cfg.scaler, enabled=False)
        self.scaler = GradScaler.from_config(scaler_config, d.device.type)
        # Parameter names for the overflow reports (metrics.jsonl's "overflow"), first: a later
        # registration with a grad_layout below then sets the layout.
        self.scaler.register_model(self.par.state_module)
        # The gradients' layout (DDP's replication, FSDP1's sharding, a pipeline stage), for the
        # global norm of clip_grad_norm_; DTensor gradients carry theirs.
        self.par.setup_scaler(self.scaler)
        if self._resuming():
            self._load()
        self.last_step = self.start_step
        if d.is_main:
            resume_step = self.start_step if self.resumed_from is not None else None
            self.metrics = MetricsLog(self.out / METRICS_NAME, resume_step=resume_step)
        inject = cfg.inject_inf is not None and cfg.inject_inf.rank == d.rank
        self.inject_steps = set(cfg.inject_inf.steps) if inject else set()  # type: ignore[union-attr]
        self.timer = PhaseTimer(d.device)
        self.scale = self.scaler.get_scale()  # the scale the next step's gradients carry

    def _resuming(self) -> bool:
        if self.resume is None:
            return False
        # Every rank reads the checkpoint of its own node: all or none must find it, or some
        # would resume and the others start over (or wait for them in a collective).
        found = gather_objects((self.ckpt_path.is_file(), socket.gethostname()), self.d)
        if len({has for has, _ in found}) > 1:
            raise RuntimeError(self._missing_message(found))
        if not found[0][0] and self.resume == "auto":
            logger.info("--resume auto: no checkpoint in %s, starting from step 0", self.out)
            return False
        return True

    def _missing_message(self, found: list[tuple[bool, str]]) -> str:
        """What to do when the checkpoint is on some nodes only; ``found``: (whether the rank
        sees it, its host) per rank."""

        def hosts(has: bool) -> str:
            ranks: dict[str, list[int]] = {}
            for rank, (f, host) in enumerate(found):
                if f == has:
                    ranks.setdefault(host, []).append(rank)
            return ", ".join(f"{host} (ranks {r})" for host, r in ranks.items())

        if self.par.sharded_checkpoint:
            fix = (
                f"the {self.cfg.parallelism} layout writes each rank's shards where it runs and "
                "reads them back from every rank, so across nodes --out must be on a filesystem "
                "they all share"
            )
        else:
            fix = (
                f"every node's first rank writes a copy at each checkpoint; copy {self.ckpt_path} "
                "from a node that has it to the same path on the others, or start without --resume"
            )
        return (
            f"--resume: no checkpoint {self.ckpt_path} on {hosts(False)}; it is on {hosts(True)}. "
            f"Each rank reads the one on its own node: {fix}"
        )

    def _load(self) -> None:
        self.start_step = load_checkpoint(
            self.ckpt_path,
            model=self.par.state_module,
            optimizer=self.optimizer,
            scaler=self.scaler,
            sampler=self.sampler,
            cfg=self.cfg,
            d=self.d,
        )
        steps = gather_objects((self.start_step, socket.gethostname()), self.d)
        if len({step for step, _ in steps}) > 1:
            saved = ", ".join(
                f"rank {r} on {host}: step {step}" for r, (step, host) in enumerate(steps)
            )
            raise RuntimeError(
                f"--resume: the nodes' copies of {self.ckpt_path} are of different steps ({saved}); "
                "remove the stale ones or copy the newest to every node"
            )
        state = self.scaler.state_dict()
        self.resumed_from = {
            "step": self.start_step,
            "scale": state["scale"],
            "growth_tracker": state["_growth_tracker"],
            "num_skipped_steps": state.get("num_skipped_steps"),
            "restart": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0)),
        }
        logger.info(
            "resumed from %s at step %d: scale %g, growth tracker %d, %s skipped step(s) so far "
            "(torchrun restart %d)",
            self.ckpt_path,
            self.start_step,
            state["scale"],
            state["_growth_tracker"],
            state.get("num_skipped_steps"),
            self.resumed_from["restart"],
        )

    # -------------------------------------------------------------------------------- step

    def step(self, step: int) -> dict[str, Any]:
        """Optimizer step ``step`` (1-based); returns its metrics record (written by rank 0)."""
        cfg, d = self.cfg, self.d
        t0 = time.perf_counter()
        lr = lr_at(step, cfg)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        starts = torch.randint(
            len(self.train_data) - cfg.block_size - 1, (cfg.batch_size,), generator=self.sampler
        )
        x, y = get_batch(self.train_data, starts, cfg.block_size, d.device)
        # CommDebugMode counts the collectives of the scaler phase on one step after warm-up (the
        # second of this run, or the only one); that step is left out of the timing median.
        measured = step == self.start_step + min(2, cfg.steps - self.start_step)
        comm = CommDebugMode() if measured else None
        loss, grad_norm = train_step(
            self.par,
            self.optimizer,
            self.scaler,
            x,
            y,
            cfg,
            inject=step in self.inject_steps,
            bitflip=self.inject_bitflip is not None and self.inject_bitflip == (step, d.rank),
            timer=self.timer,
            comm=comm,
        )
        # The step's host reads, all after it: loss, norm and the agreed skip flag in one
        # transfer, then the next scale.
        flag = self.scaler.found_inf  # None when the scaler is disabled (amp: false)
        read = [loss.float(), grad_norm] + ([flag.to(loss.device)] if flag is not None else [])
        loss_value, norm_value, *skip = torch.stack(read).tolist()
        if comm is not None:
            self.comm_counts = {str(op): n for op, n in comm.get_comm_counts().items()}
        else:
            self.scaler_times.append(self.timer.seconds())
        overflowed = bool(skip and skip[0])
        skipped = overflowed
        mismatch = self.scaler.last_replica_mismatch if self.scaler.is_enabled() else None
        if mismatch is not None and mismatch is not self._last_mismatch:
            # The replica check skipped this step (found_inf says whether it overflowed too: an
            # inf written on one rank after the reduce is both).
            self._last_mismatch = mismatch
            skipped = True
            self.replica_mismatches.append(
                {"step": step, "what": mismatch.what, "ranks": list(mismatch.ranks)}
            )
        dt = time.perf_counter() - t0
        self.train_time += dt
        if skipped:
            self.skipped_steps.append(step)
        record = step_record(
            step,
            loss=loss_value,
            scale=self.scale,
            skipped=skipped,
            grad_norm=norm_value,
            lr=lr,
            tokens_per_s=self.tokens_per_step / dt,
        )
        if self.replica_mismatches and self.replica_mismatches[-1]["step"] == step:
            record["replica_mismatch"] = self.replica_mismatches[-1]
        if overflowed:
            # Which ranks and parameters held the inf/NaN (every rank calls: they all skipped).
            report = self.scaler.report_overflow()
            if report is not None:
                record["overflow"] = [dataclasses.asdict(e) for e in report.entries]
        self.scale = self.scaler.get_scale()
        if cfg.eval_interval and step % cfg.eval_interval == 0 and step < cfg.steps:
            record["eval_loss"] = evaluate(self.par, self.held_out, cfg, d)
            logger.info("step %d: eval loss %.4f", step, record["eval_loss"])
        if self.metrics is not None:
            self.metrics.append(record)
        if cfg.ckpt_interval and step % cfg.ckpt_interval == 0 and step < cfg.steps:
            self.checkpoint(step)
        self.last_step = step
        return record

    @property
    def tokens_per_step(self) -> int:
        """Tokens of one optimizer step, all data-parallel replicas together."""
        return self.cfg.batch_size * self.cfg.block_size * self.par.dp_size

    def checkpoint(self, step: int) -> None:
        """``ckpt.pt`` (and DCP shards) of the state after ``step``; every rank must call it."""
        save_checkpoint(
            self.ckpt_path,
            step=step,
            model=self.par.state_module,
            optimizer=self.optimizer,
            scaler=self.scaler,
            sampler=self.sampler,
            cfg=self.cfg,
            d=self.d,
            sharded=self.par.sharded_checkpoint,
        )

    # ------------------------------------------------------------------------------ finish

    def finish(self) -> dict[str, Any]:
        """Final checkpoint and evaluation, the ranks' agreement (raises if they disagree), then
        ``summary.json`` and ``metrics.png`` on rank 0; returns the summary."""
        cfg, d = self.cfg, self.d
        if self.metrics is not None:
            self.metrics.close()
        self.checkpoint(self.last_step)
        eval_loss = evaluate(self.par, self.held_out, cfg, d)
        final_scale = self.scaler.get_scale()
        view = RankView(
            rank=d.rank,
            skipped_steps=tuple(self.skipped_steps),
            scale=final_scale,
            # Parameters compared in full (DTensors gathered, FSDP1 unsharded) between the ranks
            # that hold the same ones: all of them, or the replicas of each pipeline stage.
            params_digest=self.par.params_digest(),
            replica=self.par.replica_key,
            host=socket.gethostname(),
        )
        views = gather_objects(view, d)
        problems = ranks_agree(views)
        for problem in problems:
            logger.error("ranks disagree: %s", problem)
        if problems:
            raise RuntimeError("ranks disagree on skipped steps, scale or parameters (see above)")

        records = self.metrics.records if self.metrics is not None else []
        steps_run = self.last_step - self.start_step
        summary = summarize(
            records,
            steps_this_run=steps_run,
            resumed_from=self.resumed_from,
            final_scale=final_scale,
            eval_loss=eval_loss,
            tokens_per_s=steps_run * self.tokens_per_step / self.train_time
            if self.train_time
            else None,
            wall_s=time.perf_counter() - self.t_start,
            world_size=d.world_size,
            device=str(d.device),
            num_params=self.par.num_params,
            ranks_consistent=True,
            # Each rank's own count of the steps it skipped in this run (all equal: checked above)
            skipped_per_rank=[len(v.skipped_steps) for v in views],
            # Where each rank ran: the layout's groups placed on nodes (multi-node runs).
            hosts=[v.host for v in views],
            # One digest per replica group (checked equal within it above): runs of the same job
            # on other launches (one host or several, another world layout) compare by it.
            params_digests=params_digests(views),
            parallelism=cfg.parallelism,
            layout=self.par.describe,
            scaler_collectives_per_step=sum(self.comm_counts.values())
            if self.comm_counts
            else None,
            scaler_collectives=self.comm_counts,
            scaler_phase_ms_median=1e3 * statistics.median(self.scaler_times)
            if self.scaler_times
            else None,
            # The replica check (distscaler.replica_check): updates whose replicated gradients
            # were compared, and the mismatches that skipped a step (step, ranks named).
            replica_checks=self.scaler.replica_ledger.checks,
            replica_mismatches=self.replica_mismatches,
        )
        if d.is_main:
            write_summary(self.out / SUMMARY_NAME, summary)
            self._log_summary(summary)
            self._plot(records)
        return summary

    def _log_summary(self, summary: dict[str, Any]) -> None:
        def number(value: float | None) -> float:
            return math.nan if value is None else value

        logger.info(
            "done: %d steps (%d this run, %d skipped; %d growths, %d backoffs), final scale %g, "
            "loss %.4f -> %.4f, eval loss %.4f, %.0f tok/s, wall %.1f s; ranks consistent: %s; "
            "scaler phase (clip_grad_norm_ + step + update): %s collective(s) %s, median %.3f ms",
            summary["steps"],
            summary["steps_this_run"],
            summary["skipped_steps"],
            summary["num_growths"],
            summary["num_backoffs"],
            summary["final_scale"],
            number(summary["first_loss"]),
            number(summary["last_loss"]),
            summary["eval_loss"],
            number(summary["tokens_per_s"]),
            summary["wall_s"],
            summary["ranks_consistent"],
            summary["scaler_collectives_per_step"],
            summary["scaler_collectives"],
            number(summary["scaler_phase_ms_median"]),
        )
        mismatches = summary["replica_mismatches"]
        logger.info(
            "replica check: %d update(s) compared across replicas, %d mismatch(es)%s",
            summary["replica_checks"],
            len(mismatches),
            "".join(
                f"; step {m['step']}: {m['what']} of rank(s) {m['ranks']} differed, skipped"
                for m in mismatches
            ),
        )

    def _plot(self, records: list[dict[str, Any]]) -> None:
        """``metrics.png``; a failure is a warning: the metrics and the summary are already written."""
        if not records:
            return
        path = self.out / PLOT_NAME
        title = f"{len(records)} steps, {self.d.world_size} rank(s)"
        try:
            plot_metrics(records, path, title=title)
        except Exception as e:  # the run's results are on disk; the plot can be drawn later
            logger.warning(
                "could not draw %s (%s: %s); metrics.jsonl and summary.json are complete, and "
                "`python launch/plot_metrics.py %s` draws it later",
                path,
                type(e).__name__,
                e,
                self.out,
            )

    # --------------------------------------------------------------------------------- run

    def run(self) -> dict[str, Any]:
        """``setup``, every remaining step with a progress bar on rank 0, ``finish``."""
        self.setup()
        cfg = self.cfg
        bar = tqdm(
            total=cfg.steps,
            initial=self.start_step,
            disable=not self.d.is_main,
            desc="train",
            unit="step",
            dynamic_ncols=True,
            mininterval=1.0,
        )
        try:
            with logging_redirect_tqdm():
                for step in range(self.start_step + 1, cfg.steps + 1):
                    scale = self.scale
                    record = self.step(step)
                    loss = math.nan if record["loss"] is None else record["loss"]
                    bar.set_postfix(loss=f"{loss:.3f}", scale=f"{scale:g}", refresh=False)
                    bar.update()
                    if cfg.log_interval and step % cfg.log_interval == 0:
                        logger.info(
                            "step %d/%d: loss %.4f scale %g grad_norm %s lr %.2e %.0f tok/s",
                            step,
                            cfg.steps,
                            loss,
                            scale,
                            record["grad_norm"],
                            record["lr"],
                            record["tokens_per_s"],
                        )
        finally:
            bar.close()
        return self.finish()
