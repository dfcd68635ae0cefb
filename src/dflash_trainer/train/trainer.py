"""The training loop.

`Trainer.__init__` builds the parts in this order, one builder per stage, each reading
the ones before it:
  1. `_build_world`: torchrun ranks and devices, the run directory (refusing to start
     over a run that has checkpoints unless asked; on resume, the checkpoint to continue,
     checked against the config before any weights load), config and provenance files;
  2. `_build_target`: the frozen target (taps) and the drafter spec derived from it;
  3. `_build_drafter`: the drafter, optionally from a published or exported drafter;
  4. `_build_parallelism`: data parallelism (DDP / FSDP2) around the drafter;
  5. `_build_compile`: whether to compile, fixed shapes, the step settings. Compilation
     itself is *lazy*: FlexAttention is compiled on the first step, where the ranks
     take turns (distributed.one_rank_at_a_time), never here, where every rank would
     compile and autotune at once;
  6. `_build_data`: prepared shards (prepared on first use), the token-budget batcher
     and the run's step count;
  7. `_build_optimizer`: optimizer and schedule (the schedule needs the step count);
  8. `_build_checkpointer`: checkpoints, then the resumed state restored
     (train/checkpoint.py says what a checkpoint holds);
  9. `_build_metrics`: JSONL and TensorBoard, cut back to the resumed step.
`train()` is the loop; `train_step()` and its stages are in train/stepping.py, what the
run writes of its drafter (checkpoints, the final drafter, plots) in train/run_outputs.py.
"""

from __future__ import annotations

import math
import signal
import sys
from pathlib import Path
from typing import Any

import torch

from dflash_trainer.config import Config
from dflash_trainer.core.geometry import resolve_drafter_spec
from dflash_trainer.data.tokenizer_check import check_train_data
from dflash_trainer.dir_lock import DirLock, acquire
from dflash_trainer.errors import DFlashError
from dflash_trainer.eval.in_training import InTrainingEval
from dflash_trainer.lineage.training import Inheritance, check_fresh
from dflash_trainer.target.configs import allow_remote_code
from dflash_trainer.target.model import FrozenTarget, load_target_model
from dflash_trainer.train import distributed as D
from dflash_trainer.train.batching import Position, TokenBudgetBatcher, first_supervised_of
from dflash_trainer.train.checkpoint import CheckpointData, Checkpointer
from dflash_trainer.train.dataset import TrainData, load_train_data, tokenizer_spec
from dflash_trainer.train.drafter_init import init_drafter_from, init_output_norm, new_drafter
from dflash_trainer.train.fast_step import build_fast_step
from dflash_trainer.train.metrics_window import console_line, window_record
from dflash_trainer.train.optim import build_optimizer, build_scheduler
from dflash_trainer.train.resume_check import (
    Change,
    check_checkpoint,
    check_checkpoint_config,
    check_saved_config,
)
from dflash_trainer.train.run_dir import MetricsLog, check_fresh_start, write_run_files
from dflash_trainer.train.run_outputs import save_checkpoint, write_final_drafter, write_plots
from dflash_trainer.train.step import (
    settings_for_spec,
)
from dflash_trainer.train.stepping import Stepper, StepStats, TargetPrefetcher
from dflash_trainer.train.train_state import restore_state


def _warn(msg: str) -> None:
    print(f"[dflash] {msg}", file=sys.stderr, flush=True)


def _quiet(msg: str) -> None:
    """Other ranks read the same checkpoints: rank 0 alone reports on them."""


class Trainer(Stepper):
    checkpointer: Checkpointer

    def __init__(
        self,
        cfg: Config,
        resume: bool = False,
        argv: list[str] | None = None,
        log_to_console: bool = True,
        data: TrainData | None = None,
        overwrite: bool = False,
        dry_run: bool = False,
        allow_config_change: bool = False,
    ) -> None:
        """Build a run (stages in the module docstring's order).

        resume: continue from the newest intact checkpoint. overwrite: start over in a
        run directory that has checkpoints, deleting them; without it that is refused.
        dry_run: `dflash train --dry-run` (its own scratch run directory, rewritten each
        time; nothing outside it is cleaned up or deleted). allow_config_change: resume
        even if the config changes what the run trains (train/resume_check.py).
        """
        self.cfg = cfg
        self.dry_run = dry_run
        self.allow_config_change = allow_config_change
        self._config_changes: list[Change] = []
        self._lock: DirLock | None = None
        try:
            self._build_world(log_to_console, resume, overwrite, argv)
            self._build_target()
            self._build_drafter()
            self._build_parallelism()
            self._build_compile()
            self._build_data(data)
            self._build_optimizer()
            self._build_checkpointer(resume)
            self._build_metrics(resume)
        except BaseException:
            self.release()
            raise

    def release(self) -> None:
        """Give up the run directory's lock (train() does at its end; idempotent)."""
        if self._lock is not None:
            self._lock.release()
            self._lock = None

    # --------------------------------------------------------------- builders

    def _build_world(
        self, log_to_console: bool, resume: bool, overwrite: bool, argv: list[str] | None
    ) -> None:
        self.world = D.init_world(self.cfg.distributed, self.cfg.training.device)
        self.run_dir = Path(self.cfg.run.output_dir)
        self.console = log_to_console and self.world.is_main
        if self.world.is_main:
            # Before any file of the run is read or written; released by train() or a failure.
            self._lock = acquire(self.run_dir, "dflash train", f"run directory {self.run_dir}")
        if not resume and not self.dry_run:
            # Before any file of the run is rewritten: a fresh start over checkpoints
            # would silently move LATEST back and repeat metrics rows.
            check_fresh_start(self.cfg, self.run_dir, overwrite, self.world.is_main, self._log)
        self._resume_from = self._resume_point() if resume else None
        if self.world.is_main:
            write_run_files(self.run_dir, self.cfg, argv, _warn, self._config_changes)

    def _resume_point(self) -> CheckpointData:
        """The checkpoint a resume continues, checked before the target loads, in this order:
        the target's repository code (a config.yaml that asks to run it, say in a run
        directory someone sent, is refused before anything else is compared or loaded), then
        this config against RUN/config.yaml and against what the checkpoint recorded, so a
        changed run is refused at once."""
        allow_remote_code(self.cfg.target)
        allow = self.allow_config_change
        self._config_changes = check_saved_config(self.run_dir, self.cfg, allow, self._warn)
        data = self._checkpointer().load()
        self._config_changes += check_checkpoint_config(
            data, self.cfg, self._config_changes, allow, self._warn
        )
        return data

    def _checkpointer(self) -> Checkpointer:
        if getattr(self, "checkpointer", None) is None:
            cfg = self.cfg
            self.checkpointer = Checkpointer(
                cfg.run.checkpoint_dir or str(self.run_dir / "checkpoints"),
                cfg.training.keep_last,
                cfg.run.storage_options,
                _warn if self.world.is_main else _quiet,
                not self.dry_run,
            )
        return self.checkpointer

    def _build_target(self) -> None:
        # Whole on each rank, FSDP-sharded over the ranks (loaded on the host, then
        # 1/world of each decoder layer per GPU), or spread over one process's GPUs.
        cfg, dcfg = self.cfg, self.cfg.distributed
        self._log(f"loading target {cfg.target.name_or_path} ...")
        model = load_target_model(
            cfg.target,
            D.target_load_device(dcfg, self.world),
            max_memory=D.target_max_memory(dcfg, self.world),
        )
        self.spec = resolve_drafter_spec(cfg.drafter, model.config)
        D.apply_target_sharding(model, dcfg, self.world)
        self.target = FrozenTarget(model, self.spec.target_layer_ids)

    def _build_drafter(self) -> None:
        t = self.cfg.training
        torch.manual_seed(t.seed)
        emb = self.target.model.get_input_embeddings().weight
        codebooks = self.cfg.drafter.selector_codebooks
        self.drafter = new_drafter(
            self.spec, t.noise_std, codebooks, emb, self.world.drafter_device
        )
        self.inherited = Inheritance()  # a drafter from scratch: the lineage starts here
        if self.cfg.drafter.init_from:
            path = self.cfg.drafter.init_from
            state = init_drafter_from(self.drafter, self.spec, path, self._log)
            self.inherited = Inheritance.of(path, state)
            n = len((self.inherited.parent or {}).get("continuations", []))
            self._log(f"drafter initialised from {path} (its lineage: {n} continuations)")
        else:
            init_output_norm(self.drafter, self.target.lm_head_weight)
        self.drafter.to(self.world.drafter_device).train()

    def _build_parallelism(self) -> None:
        if self.world.distributed and not self.cfg.training.pack_documents:
            raise DFlashError(
                "training.pack_documents=false (the unpacked benchmark baseline) runs a "
                "different number of drafter forwards per rank, which data parallelism "
                "cannot synchronise; use it with one process"
            )
        self.model = D.wrap_data_parallel(self.drafter, self.cfg.distributed, self.world)
        self._lm_head: torch.Tensor | None = None
        self._embed_table: torch.Tensor | None = None
        # pairs: the target stage of the next step runs in one background thread
        # (started after the warm-up step, see train()), overlapping the drafter step.
        self.prefetch: TargetPrefetcher | None = None

    def _build_compile(self) -> None:
        t = self.cfg.training
        dev = self.world.drafter_device
        self.compile = t.compile if t.compile is not None else dev.type == "cuda"
        if self.compile and dev.type == "cuda" and self.spec.head_dim < 16:
            # Compiled FlexAttention on CUDA has no kernel below 16 dimensions a head: say
            # so now instead of an Inductor lowering error inside the first step.
            raise DFlashError(
                f"drafter head_dim {self.spec.head_dim} is below 16, the smallest compiled "
                "FlexAttention supports on CUDA: set drafter.head_dim >= 16 (published drafters "
                "use 64-128) or training.compile=false"
            )
        if self.compile:
            D.set_compile_cache(self.run_dir, self.world.rank)
        self.fixed_shapes = self.compile and t.pack_documents
        self._attn_fn: Any = None  # built on the first step, see _attention
        self.settings = settings_for_spec(self.cfg, self.spec, self.fixed_shapes)
        use_bf16 = t.precision == "bf16" and dev.type == "cuda"
        self.autocast = torch.bfloat16 if use_bf16 else None
        self.anchor_gen = torch.Generator().manual_seed(t.seed + 1000 * self.world.rank)

    def _build_data(self, data: TrainData | None) -> None:
        cfg, t = self.cfg, self.cfg.training
        self.data = data or load_train_data(cfg, self.run_dir, self.world.is_main)
        check_train_data(self.data, cfg.target, self.spec.vocab_size, self._warn)
        self.batcher = TokenBudgetBatcher(
            self.data.train.lengths,
            cfg.data.token_budget,
            cfg.data.doc_limit,
            cfg.data.shuffle_seed,
            self.world.rank,
            self.world.world_size,
            first_supervised_of(self.data.train),
        )
        if note := self.batcher.unsupervised_note():
            self._log(note)
        micro_per_epoch = self.batcher.steps_per_epoch
        self.total_steps = t.max_steps or max(
            1, math.ceil(t.epochs * micro_per_epoch / t.grad_accum_steps)
        )
        self.in_training_eval = InTrainingEval(cfg, tokenizer_spec(cfg.target), self.data.eval)
        check_fresh(self.inherited, self.data.path)  # never a prompt the lineage trained on

    def _build_optimizer(self) -> None:
        self.optimizer = build_optimizer(self.drafter, self.cfg.training)
        self.scheduler = build_scheduler(self.optimizer, self.cfg.training, self.total_steps)

    def _build_checkpointer(self, resume: bool) -> None:
        self._checkpointer()
        self.step = 0
        self.micro_steps = 0  # micro-steps drawn (empty steps draw without stepping)
        self.position = Position()
        self.bad_steps = 0
        self.skipped_total = 0
        self.truncated_total = 0
        self.tokens_seen = 0
        if resume:
            data = self._resume_from
            assert data is not None  # loaded by _build_world
            check_checkpoint(self, data)  # its geometry and data, beside this run's
            restore_state(self, data)
            self._log(f"resumed from {data.location} at step {self.step}")

    def _build_metrics(self, resume: bool) -> None:
        self.metrics = MetricsLog(self.run_dir, enabled=self.world.is_main)
        # Rows past the resumed step are redone; a fresh start redoes them all.
        damaged = self.metrics.truncate_after(self.step if resume else 0)
        if damaged:
            self._warn(f"{self.metrics.path}: dropped {damaged} damaged row(s) (not JSON rows)")
        self._stop_signal: int | None = None
        # The step function: the fast step (fixed shapes, graphs) or the Stepper's own.
        self.fast, why = build_fast_step(self)
        self._log(why)

    # ---------------------------------------------------------------- helpers

    def _log(self, msg: str) -> None:
        if self.console:
            print(f"[dflash] {msg}", flush=True)

    def _warn(self, msg: str) -> None:
        """On stderr, from rank 0 alone, whatever log_to_console says."""
        if self.world.is_main:
            _warn(msg)

    # ------------------------------------------------------------------- loop

    def train_step(self) -> StepStats:
        """One optimizer step: the fast step when the run uses it, else the Stepper's."""
        if self.fast is not None:
            return StepStats(*self.fast.train_step())
        return super().train_step()

    def train(self) -> dict[str, Any]:
        from tqdm import tqdm

        self._install_signal_handlers()
        bar = tqdm(
            total=self.total_steps,
            initial=self.step,
            disable=not self.console,
            desc="train",
            dynamic_ncols=True,
            mininterval=2.0,
        )
        self._log(
            f"{self.total_steps} steps ({self.batcher.steps_per_epoch} per epoch per rank), "
            f"drafter {sum(p.numel() for p in self.drafter.parameters()) / 1e6:.1f}M params, "
            f"compile={'on' if self.compile else 'off'}"
        )
        first = self.step
        try:
            stopped = self._loop(bar)
            if stopped is not None:
                return stopped
            self._check_ending(first)
            last_ckpt = self.save_checkpoint()
            write_final_drafter(self)
            write_plots(self)
        finally:
            if self.prefetch is not None:
                self.prefetch.close()
            bar.close()
            self.metrics.close()
            self.release()
        return {"step": self.step, "stopped": False, "checkpoint": last_ckpt}

    def _loop(self, bar: Any) -> dict[str, Any] | None:
        """Steps until the end of the schedule (None) or a signal (the stop record)."""
        t = self.cfg.training
        window: list[StepStats] = []
        empty_run = 0
        while self.step < self.total_steps:
            st = self.train_step()
            if self.cfg.distributed.placement == "pairs" and self.prefetch is None:
                # Warm-up done (compile, autotune) on this thread: now overlap.
                self.prefetch = TargetPrefetcher(self)
            if st.empty:
                empty_run = self._empty_step(empty_run + 1)
                continue
            empty_run = 0
            window.append(st)
            bar.update(1)
            if st.skipped:
                self._bad_step()
            if self.step % t.log_every == 0 or self.step == self.total_steps:
                rec = self._log_window(window)
                bar.set_postfix(loss=f"{rec['loss']:.3f}", tau=f"{rec['exact_tau']:.2f}")
                window = []
            if t.eval_every and self.step % t.eval_every == 0:
                self._in_training_eval()
            if self.step % t.checkpoint_every == 0 and self.step < self.total_steps:
                if self.bad_steps == 0:
                    self.save_checkpoint()
                else:
                    # Never let an unstable state replace the last good checkpoint.
                    self._log(f"step {self.step}: checkpoint skipped after non-finite steps")
            if self._stop_signal is not None:
                last_ckpt = self.save_checkpoint()
                self._log(
                    f"stopped by signal {self._stop_signal} at step {self.step}; checkpoint "
                    f"{last_ckpt}; continue with: dflash train --resume {self.run_dir}"
                )
                return {"step": self.step, "stopped": True, "checkpoint": last_ckpt}
        return None

    def _check_ending(self, first: int) -> None:
        """A schedule shorter than max_bad_steps could end with every step non-finite and be
        reported as a finished run: refuse that; say it when only the last steps were."""
        if self.bad_steps == 0 or self.step == first:  # a resume with no step left to run
            return
        if self.bad_steps >= self.step - first:
            where = self.checkpointer.latest() or "none yet"
            raise DFlashError(
                f"every step of this run ({self.bad_steps}, to step {self.step}) had a "
                f"non-finite loss or gradient; nothing was trained and no drafter is written. "
                f"The last good checkpoint ({where}) is intact: check the target (its config "
                "and weights give non-finite hidden states?), the data, or lower training.lr"
            )
        self._log(
            f"the last {self.bad_steps} steps were non-finite and skipped: the final weights "
            f"are those of step {self.step - self.bad_steps}"
        )

    def _bad_step(self) -> None:
        self._log(f"step {self.step}: non-finite loss or gradient, step skipped")
        if self.bad_steps >= self.cfg.training.max_bad_steps:
            where = self.checkpointer.latest() or "none yet"
            raise DFlashError(
                f"{self.bad_steps} consecutive non-finite steps (last at step "
                f"{self.step}); stopping. The last good checkpoint ({where}) is "
                "intact: lower training.lr, check the data, or resume from it"
            )

    def _empty_step(self, empty_run: int) -> int:
        """Log an unsupervised step (skipped, data moved on); stop if they never end."""
        self._log(
            f"step {self.step + 1}: the sampled anchors have no supervised slot; skipped "
            "(the schedule does not advance, the data does)"
        )
        limit = max(self.cfg.training.max_bad_steps, 2 * self.batcher.steps_per_epoch)
        if empty_run >= limit:
            raise DFlashError(
                f"{empty_run} consecutive steps without a supervised token: the data's "
                f"loss masks supervise nothing ({self.cfg.data.train}); check the chat "
                "template and data.train"
            )
        return empty_run

    def _log_window(self, window: list[StepStats]) -> dict[str, Any]:
        rec = window_record(self, window)
        self.metrics.write(rec)
        every = self.cfg.training.log_every
        if self.console and (self.step % (every * 10) == 0 or self.step == every):
            self._log(console_line(rec))
        return rec

    def _in_training_eval(self) -> dict[str, Any] | None:
        """Served tau measured every eval_every steps (eval/in_training.py), on rank 0.

        The other ranks wait in the next collective.
        """
        if not self.world.is_main:
            return None
        rec, msg = self.in_training_eval.run(
            self.step, self.drafter, self.target, drafter_sharded=self._fsdp_drafter()
        )
        if rec is not None:
            self.metrics.write(rec)
        self._log(msg)
        return rec

    # ------------------------------------------------------------ checkpoints

    def _fsdp_drafter(self) -> bool:
        return self.world.distributed and self.cfg.distributed.data_parallel == "fsdp"

    def save_checkpoint(self) -> str | None:
        """Checkpoint now (every rank calls); train/run_outputs.py says what it refuses."""
        return save_checkpoint(self)

    def _install_signal_handlers(self) -> None:
        def handler(signum: int, _frame: Any) -> None:
            if self._stop_signal is not None:
                raise KeyboardInterrupt
            self._stop_signal = signum
            self._log(f"signal {signum}: finishing this step, then saving a checkpoint")

        for sig in (signal.SIGTERM, signal.SIGINT):
            try:
                signal.signal(sig, handler)
            except ValueError:
                pass  # not the main thread (e.g. inside a test runner thread)
