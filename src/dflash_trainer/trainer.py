"""The training loop.

`Trainer.__init__` builds the parts in this order, because each needs the previous:
  1. world (torchrun ranks, devices) and the run directory (config, provenance,
     per-rank compile caches);
  2. target (frozen, taps) and tokenizer;
  3. drafter spec (derived from the target's config) and model, optionally from a
     published or exported drafter;
  4. data (prepared shards; prepared on first use) and the token-budget batcher;
  5. data parallelism (DDP / FSDP2); compilation is *lazy*: FlexAttention is compiled
     on the first step, never at construction (seed: compiling early corrupted caches);
  6. optimizer and schedule;
  7. checkpointer, then resume (weights, optimizer, schedule, RNG, data position);
  8. metrics (JSONL, TensorBoard).
`train()` is the loop; `train_step()` reads top to bottom: target, blocks, drafter.
"""

from __future__ import annotations

import math
import signal
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from dflash_trainer import distributed as D
from dflash_trainer.batching import Position, TokenBudgetBatcher
from dflash_trainer.checkpoint import Checkpointer
from dflash_trainer.config import Config
from dflash_trainer.drafter import DFlashDrafter, flex_attention_eager, sdpa_attention
from dflash_trainer.errors import DFlashError
from dflash_trainer.geometry import resolve_drafter_spec
from dflash_trainer.optim import build_optimizer, build_scheduler
from dflash_trainer.run_dir import MetricsLog, write_run_files
from dflash_trainer.step import StepSettings, drafter_loss, prepare_blocks, run_target
from dflash_trainer.target import FrozenTarget, load_target_model
from dflash_trainer.train_data import TrainData, load_train_data


@dataclass
class StepStats:
    loss: float
    metrics: dict[str, Any]
    grad_norm: float
    skipped: bool
    target_s: float
    drafter_s: float
    tokens: int
    truncated: int


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


class Trainer:
    def __init__(
        self,
        cfg: Config,
        resume: bool = False,
        argv: list[str] | None = None,
        log_to_console: bool = True,
        data: TrainData | None = None,
    ) -> None:
        self.cfg = cfg
        t = cfg.training
        # 1. world and run directory
        self.world = D.init_world(cfg.distributed, t.device)
        self.run_dir = Path(cfg.run.output_dir)
        self.console = log_to_console and self.world.is_main
        if self.world.is_main:
            write_run_files(self.run_dir, cfg, argv)
        self.compile = (
            t.compile if t.compile is not None else self.world.drafter_device.type == "cuda"
        )
        if self.compile:
            D.set_compile_cache(self.run_dir, self.world.rank)

        # 2. target
        self._log(f"loading target {cfg.target.name_or_path} ...")
        model = load_target_model(cfg.target, self.world.target_device)
        self.spec = resolve_drafter_spec(cfg.drafter, model.config)
        self.target = FrozenTarget(model, self.spec.target_layer_ids)

        # 3. drafter
        torch.manual_seed(t.seed)
        self.drafter = DFlashDrafter(self.spec, noise_std=t.noise_std)
        if cfg.drafter.init_from:
            self._init_drafter_from(cfg.drafter.init_from)
        self.drafter.to(self.world.drafter_device).train()

        # 4. data
        self.data = data or load_train_data(cfg, self.run_dir, self.world.is_main)
        self.batcher = TokenBudgetBatcher(
            self.data.train.lengths,
            cfg.data.token_budget,
            cfg.data.doc_limit,
            cfg.data.shuffle_seed,
            self.world.rank,
            self.world.world_size,
        )
        micro_per_epoch = self.batcher.steps_per_epoch
        self.total_steps = t.max_steps or max(
            1, math.ceil(t.epochs * micro_per_epoch / t.grad_accum_steps)
        )

        # 5. parallelism (compile is lazy, see _attention)
        self.model = D.wrap_data_parallel(self.drafter, cfg.distributed, self.world)
        self._attn_fn: Any = None

        # 6. optimizer
        self.optimizer = build_optimizer(self.drafter, t)
        self.scheduler = build_scheduler(self.optimizer, t, self.total_steps)
        self.settings = StepSettings(
            block_size=self.spec.block_size,
            mask_token_id=self.spec.mask_token_id,
            max_anchors=t.max_anchors,
            labels=t.labels,
            loss=t.loss,
            weighting=t.weighting,
            gamma=t.resolved_gamma(self.spec.block_size),
            dpace_alpha=t.dpace_alpha,
            chunk_rows=t.loss_chunk_rows,
            fixed_ctx_len=(-(-cfg.data.token_budget // 128) * 128) if self.compile else None,
            fixed_anchors=self.compile,
            target_batch_tokens=max(cfg.data.token_budget, 2 * cfg.data.doc_limit),
        )
        self.autocast = (
            torch.bfloat16
            if t.precision == "bf16" and self.world.drafter_device.type == "cuda"
            else None
        )
        self.anchor_gen = torch.Generator().manual_seed(t.seed + 1000 * self.world.rank)

        # 7. checkpoints and resume
        ckpt_root = cfg.run.checkpoint_dir or str(self.run_dir / "checkpoints")
        self.checkpointer = Checkpointer(ckpt_root, t.keep_last, cfg.run.storage_options)
        self.step = 0
        self.position = Position()
        self.bad_steps = 0
        self.skipped_total = 0
        self.truncated_total = 0
        self.tokens_seen = 0
        if resume:
            self._resume()

        # 8. metrics
        self.metrics = MetricsLog(self.run_dir, enabled=self.world.is_main)
        if resume:
            self.metrics.truncate_after(self.step)
        self._stop_signal: int | None = None

    # ---------------------------------------------------------------- helpers

    def _log(self, msg: str) -> None:
        if self.console:
            print(f"[dflash] {msg}", flush=True)

    def _init_drafter_from(self, path: str) -> None:
        from dflash_trainer.drafter_io import load_drafter

        try:
            spec, state, _ = load_drafter(path)
        except DFlashError:
            from dflash_trainer.export import import_drafter

            spec, state, _ = import_drafter(path)
        if spec != self.spec:
            diffs = {
                k: (v, getattr(self.spec, k))
                for k, v in spec.to_dict().items()
                if getattr(self.spec, k) != (tuple(v) if isinstance(v, list) else v)
            }
            raise DFlashError(
                f"drafter.init_from={path}: its geometry differs from this config's: {diffs}; "
                "make the drafter section match the imported drafter"
            )
        self.drafter.load_state_dict({k: v.float() for k, v in state.items()})
        self._log(f"drafter initialised from {path}")

    def _attention(self) -> Any:
        """Lazily build the attention function: compiled FlexAttention on the first step."""
        if self._attn_fn is None:
            if self.compile:
                with D.one_rank_at_a_time(self.world):
                    self._attn_fn = torch.compile(flex_attention_eager, dynamic=False)
            else:
                self._attn_fn = sdpa_attention
        return self._attn_fn

    def _seed_micro_step(self, index: int) -> None:
        """Anchors and noise of micro-step `index` on this rank: a pure function of the seed.

        Re-seeding per step (instead of carrying RNG state) makes resume exact for any
        number of ranks and makes every rank's stream independent by construction.
        """
        base = (self.cfg.training.seed * 1_000_003 + self.world.rank) * 10_000_019 + index
        self.anchor_gen.manual_seed(base % (2**63))
        torch.manual_seed((base * 31 + 7) % (2**63))

    def _documents(self, pos: Position) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], int]:
        limit = self.cfg.data.doc_limit
        idx = self.batcher.documents(pos)
        docs = []
        for i in idx:
            d = self.data.train[i]
            ids = torch.from_numpy(d.input_ids[:limit].astype("int64"))
            mask = torch.from_numpy(d.loss_mask[:limit].astype("bool"))
            docs.append((ids, mask))
        return docs, self.batcher.truncated(idx)

    # ------------------------------------------------------------------- step

    def train_step(self) -> StepStats:
        """One optimizer step (grad_accum_steps micro-steps)."""
        t = self.cfg.training
        tdev, ddev = self.world.target_device, self.world.drafter_device
        self.optimizer.zero_grad(set_to_none=True)
        target_s = drafter_s = 0.0
        tokens = truncated = 0
        loss_sum = 0.0
        agg: dict[str, torch.Tensor] = {}
        attn = self._attention()
        for micro in range(t.grad_accum_steps):
            self._seed_micro_step(self.step * t.grad_accum_steps + micro)
            docs, trunc = self._documents(self.position)
            self.position = self.batcher.advance(self.position)
            truncated += trunc
            t0 = time.perf_counter()
            tout = run_target(self.target, docs, self.settings)
            blocks = prepare_blocks(tout, self.target, self.settings, self.anchor_gen, ddev)
            _sync(tdev)
            t1 = time.perf_counter()
            res = drafter_loss(
                self.model,
                blocks,
                self.target.embed,
                self.target.lm_head_weight.to(ddev),
                self.settings,
                attn_fn=attn,
                use_flex=self.compile,
                autocast_dtype=self.autocast,
            )
            # Weigh ranks and micro-steps by their supervised slot weight, not equally.
            local_w = res.metrics["weight_sum"].float()
            global_w = D.all_reduce_sum(local_w, self.world)
            scale = self.world.world_size * local_w / global_w.clamp(min=1e-12)
            loss = res.loss * scale / t.grad_accum_steps
            loss.backward()
            _sync(ddev)
            t2 = time.perf_counter()
            target_s += t1 - t0
            drafter_s += t2 - t1
            tokens += blocks.pack.num_tokens
            loss_sum += float(res.loss.detach()) / t.grad_accum_steps
            for k, v in res.metrics.items():
                agg[k] = agg.get(k, 0) + v.float() / t.grad_accum_steps

        grad_norm = torch.nn.utils.clip_grad_norm_(
            self.model.parameters(), t.grad_clip if t.grad_clip > 0 else float("inf")
        )
        finite = math.isfinite(loss_sum) and bool(torch.isfinite(grad_norm))
        if finite:
            self.optimizer.step()
            self.bad_steps = 0
        else:
            self.optimizer.zero_grad(set_to_none=True)
            self.bad_steps += 1
            self.skipped_total += 1
        self.scheduler.step()
        self.step += 1
        self.tokens_seen += tokens
        self.truncated_total += truncated
        return StepStats(
            loss_sum, agg, float(grad_norm), not finite, target_s, drafter_s, tokens, truncated
        )

    # ------------------------------------------------------------------- loop

    def train(self) -> dict[str, Any]:
        from tqdm import tqdm

        t = self.cfg.training
        self._install_signal_handlers()
        window: list[StepStats] = []
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
        last_ckpt = None
        try:
            while self.step < self.total_steps:
                st = self.train_step()
                window.append(st)
                bar.update(1)
                if st.skipped:
                    self._log(f"step {self.step}: non-finite loss or gradient, step skipped")
                    if self.bad_steps >= t.max_bad_steps:
                        where = self.checkpointer.latest() or "none yet"
                        raise DFlashError(
                            f"{self.bad_steps} consecutive non-finite steps (last at step "
                            f"{self.step}); stopping. The last good checkpoint ({where}) is "
                            "intact: lower training.lr, check the data, or resume from it"
                        )
                if self.step % t.log_every == 0 or self.step == self.total_steps:
                    rec = self._log_window(window)
                    bar.set_postfix(loss=f"{rec['loss']:.3f}", tau=f"{rec['exact_tau']:.2f}")
                    window = []
                if self.step % t.checkpoint_every == 0 and self.step < self.total_steps:
                    if self.bad_steps == 0:
                        last_ckpt = self.save_checkpoint()
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
            last_ckpt = self.save_checkpoint()
            self._write_final_drafter()
        finally:
            bar.close()
            self.metrics.close()
        return {"step": self.step, "stopped": False, "checkpoint": last_ckpt}

    def _log_window(self, window: list[StepStats]) -> dict[str, Any]:
        ok = [s for s in window if not s.skipped] or window
        n = len(ok)
        dt = sum(s.target_s + s.drafter_s for s in window)
        m = {k: sum(s.metrics[k] for s in ok) / n for k in ok[0].metrics}
        rec: dict[str, Any] = {
            "step": self.step,
            "epoch": self.position.epoch
            + self.position.step / max(1, self.batcher.steps_per_epoch),
            "loss": sum(s.loss for s in ok) / n,
            "accuracy": float(m["accuracy"]),
            "exact_tau": float(m["exact_tau"]),
            "expected_tau": float(m["expected_tau"]),
            "slot_acc": [round(float(x), 5) for x in m["slot_acc"]],
            "lr": self.scheduler.get_last_lr()[0],
            "grad_norm": sum(s.grad_norm for s in ok) / n,
            "tokens_per_s": sum(s.tokens for s in window) / max(dt, 1e-9) * self.world.world_size,
            "step_time_s": dt / len(window),
            "target_time_s": sum(s.target_s for s in window) / len(window),
            "drafter_time_s": sum(s.drafter_s for s in window) / len(window),
            "valid_slots": float(m["valid_slots"]),
            "tokens_seen": self.tokens_seen * self.world.world_size,
            "truncated_docs": self.truncated_total,
            "skipped_steps": self.skipped_total,
        }
        if self.world.drafter_device.type == "cuda":
            rec["peak_mem_gb"] = torch.cuda.max_memory_allocated(self.world.drafter_device) / 1e9
        self.metrics.write(rec)
        if not self.console:
            return rec
        if (
            self.step % (self.cfg.training.log_every * 10) == 0
            or self.step == self.cfg.training.log_every
        ):
            self._log(
                f"step {self.step}: loss {rec['loss']:.4f} acc {rec['accuracy']:.3f} "
                f"tau {rec['exact_tau']:.2f} lr {rec['lr']:.2e} {rec['tokens_per_s']:.0f} tok/s"
            )
        return rec

    # ------------------------------------------------------------ checkpoints

    def _meta(self) -> dict[str, Any]:
        from dflash_trainer.config import config_to_dict

        return {
            "step": self.step,
            "target": config_to_dict(self.cfg.target),
            "training": config_to_dict(self.cfg.training),
            "data": config_to_dict(self.cfg.data),
            "run": str(self.run_dir),
        }

    def save_checkpoint(self) -> str | None:
        if not all(bool(torch.isfinite(p).all()) for p in self.drafter.parameters()):
            raise DFlashError(
                f"step {self.step}: the drafter has non-finite weights; refusing to overwrite "
                f"the last good checkpoint ({self.checkpointer.latest() or 'none'})"
            )
        if not self.world.is_main:
            D.broadcast_object(None, self.world)
            return None
        state = {k: v for k, v in self.drafter.state_dict().items()}
        # Anchors and noise are re-seeded per step (_seed_micro_step); the generator
        # states are kept for inspection only.
        rng = {"torch_cpu": torch.get_rng_state(), "anchor_gen": self.anchor_gen.get_state()}
        trainer_state = {
            "step": self.step,
            "position": {"epoch": self.position.epoch, "step": self.position.step},
            "scheduler": self.scheduler.state_dict(),
            "bad_steps": self.bad_steps,
            "skipped_total": self.skipped_total,
            "truncated_total": self.truncated_total,
            "tokens_seen": self.tokens_seen,
            "world_size": self.world.world_size,
            "total_steps": self.total_steps,
        }
        loc = self.checkpointer.save(
            self.step,
            self.spec,
            state,
            self._meta(),
            self.optimizer.state_dict(),
            trainer_state,
            rng,
        )
        D.broadcast_object(loc, self.world)
        return loc

    def _resume(self) -> None:
        data = self.checkpointer.load()
        ts = data.trainer_state
        if ts.get("world_size", 1) != self.world.world_size:
            raise DFlashError(
                f"{data.location} was written by a run with {ts['world_size']} ranks; this run "
                f"has {self.world.world_size}. Resume with the same number of ranks (the data "
                "order and anchor streams are per rank)"
            )
        self.drafter.load_state_dict(data.drafter_state)
        self.optimizer.load_state_dict(data.optimizer_state)
        self.scheduler.load_state_dict(ts["scheduler"])
        self.step = ts["step"]
        self.position = Position(**ts["position"])
        self.bad_steps = ts["bad_steps"]
        self.skipped_total = ts["skipped_total"]
        self.truncated_total = ts["truncated_total"]
        self.tokens_seen = ts["tokens_seen"]
        self._log(f"resumed from {data.location} at step {self.step}")

    def _write_final_drafter(self) -> None:
        if not self.world.is_main:
            return
        from dflash_trainer.drafter_io import save_drafter_files

        save_drafter_files(
            self.run_dir / "drafter", self.spec, self.drafter.state_dict(), self._meta()
        )
        self._log(f"final drafter written to {self.run_dir / 'drafter'}")

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
