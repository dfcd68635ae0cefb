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

import dataclasses
import math
import queue
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from dflash_trainer.config import Config
from dflash_trainer.core.drafter import DFlashDrafter, flex_attention_eager, sdpa_attention
from dflash_trainer.core.geometry import resolve_drafter_spec
from dflash_trainer.core.loss import decay_weights
from dflash_trainer.errors import DFlashError
from dflash_trainer.target.model import FrozenTarget, load_target_model
from dflash_trainer.train import distributed as D
from dflash_trainer.train.batching import Position, TokenBudgetBatcher
from dflash_trainer.train.checkpoint import Checkpointer
from dflash_trainer.train.dataset import TrainData, load_train_data
from dflash_trainer.train.fast_step import build_fast_step
from dflash_trainer.train.optim import build_optimizer, build_scheduler
from dflash_trainer.train.run_dir import MetricsLog, write_run_files
from dflash_trainer.train.step import (
    StepSettings,
    drafter_loss,
    prepare_blocks,
    run_target,
    settings_from_config,
)


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


@dataclass
class _Staged:
    """Output of the target stage of one micro-step."""

    index: int
    units: list[tuple[Any, StepSettings]]
    truncated: int
    seconds: float


class TargetPrefetcher:
    """Runs the target stage one micro-step ahead in a single background thread.

    Only this thread ever runs the target (and its Triton/FLA kernels), and it starts
    after the first step has compiled and autotuned everything on the main thread, so
    no autotuner or compile cache is ever used by two threads at once (the seed's
    crash). The data order is the batcher's, so results equal the sequential path.
    """

    def __init__(self, trainer: Trainer) -> None:
        self.trainer = trainer
        self.queue: queue.Queue[tuple[int, _Staged | BaseException]] = queue.Queue(maxsize=1)
        self.thread: threading.Thread | None = None
        self.stop = threading.Event()

    def _run(self, index: int, pos: Position) -> None:
        tr = self.trainer
        while not self.stop.is_set():
            try:
                item: _Staged | BaseException = tr._target_stage(index, pos)
            except BaseException as e:  # handed to the main thread, which raises it
                item = e
            while not self.stop.is_set():
                try:
                    self.queue.put((index, item), timeout=0.5)
                    break
                except queue.Full:
                    continue
            if isinstance(item, BaseException):
                return
            index += 1
            pos = tr.batcher.advance(pos)

    def get(self, index: int, pos: Position) -> _Staged:
        if self.thread is None:
            self.thread = threading.Thread(target=self._run, args=(index, pos), daemon=True)
            self.thread.start()
        got_index, item = self.queue.get()
        if isinstance(item, BaseException):
            raise item
        assert got_index == index, f"prefetched micro-step {got_index}, expected {index}"
        return item

    def close(self) -> None:
        self.stop.set()
        if self.thread is not None:
            while True:
                try:
                    self.queue.get_nowait()
                except queue.Empty:
                    break
            self.thread.join(timeout=60)


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
        self.fixed_shapes = self.compile and t.pack_documents

        # 2. target: whole on each rank, FSDP-sharded over the ranks (loaded on the host,
        # then 1/world of each decoder layer per GPU), or spread over one process's GPUs
        self._log(f"loading target {cfg.target.name_or_path} ...")
        dcfg = cfg.distributed
        model = load_target_model(
            cfg.target,
            D.target_load_device(dcfg, self.world),
            max_memory=D.target_max_memory(dcfg, self.world),
        )
        self.spec = resolve_drafter_spec(cfg.drafter, model.config)
        D.apply_target_sharding(model, dcfg, self.world)
        self.target = FrozenTarget(model, self.spec.target_layer_ids)

        # 3. drafter
        torch.manual_seed(t.seed)
        self.drafter = DFlashDrafter(self.spec, noise_std=t.noise_std)
        if cfg.drafter.init_from:
            self._init_drafter_from(cfg.drafter.init_from)
        else:
            self._init_output_norm()
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

        if self.world.distributed and not t.pack_documents:
            raise DFlashError(
                "training.pack_documents=false (the unpacked benchmark baseline) runs a "
                "different number of drafter forwards per rank, which data parallelism "
                "cannot synchronise; use it with one process"
            )

        # 5. parallelism (compile is lazy, see _attention)
        self.model = D.wrap_data_parallel(self.drafter, cfg.distributed, self.world)
        self._attn_fn: Any = None
        self._lm_head: torch.Tensor | None = None
        self._embed_table: torch.Tensor | None = None
        # pairs: the target stage of the next step runs in one background thread
        # (started after the warm-up step, see train()), overlapping the drafter step.
        self.prefetch: TargetPrefetcher | None = None

        # 6. optimizer
        self.optimizer = build_optimizer(self.drafter, t)
        self.scheduler = build_scheduler(self.optimizer, t, self.total_steps)
        self.settings = settings_from_config(cfg, self.spec.mask_token_id, self.fixed_shapes)
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
        # The step function: the fast step (fixed shapes, graphs) or train_step's own.
        self.fast, why = build_fast_step(self)
        self._log(why)

    # ---------------------------------------------------------------- helpers

    def _log(self, msg: str) -> None:
        if self.console:
            print(f"[dflash] {msg}", flush=True)

    def _init_output_norm(self) -> None:
        """Scale the drafter's final norm so its first logits have unit spread.

        Logits are the target's lm_head applied to norm(h). With a unit norm weight the
        random first outputs come out as confident as the lm_head's scale allows (SmolLM2:
        initial CE ~23 against ~11 for uniform), and the first steps are spent only
        shrinking that scale. With weight c = 1 / (std(lm_head) * sqrt(H)) a random
        direction gives logits of std ~1: the loss starts near log(V).
        """
        w = self.target.lm_head_weight.float()
        c = 1.0 / (float(w.std()) * math.sqrt(w.shape[1]))
        with torch.no_grad():
            self.drafter.norm.weight.fill_(c)

    def _init_drafter_from(self, path: str) -> None:
        from dflash_trainer.formats.drafter_io import load_drafter

        try:
            spec, state, _ = load_drafter(path)
        except DFlashError:
            from dflash_trainer.formats.export import import_drafter

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
                dynamic = False if self.fixed_shapes else None
                with D.one_rank_at_a_time(self.world):
                    self._attn_fn = torch.compile(flex_attention_eager, dynamic=dynamic)
                    # Compiling each layer in place (keys unchanged) fuses norms, RoPE and
                    # SwiGLU: 280 -> 240 ms and 34.6 -> 29.5 GB on the 27B drafter step
                    # (benchmarks/drafter_step_h200_202612.md).
                    for layer in self.drafter.layers:
                        layer.compile(dynamic=dynamic)
            else:
                self._attn_fn = sdpa_attention
        return self._attn_fn

    def _stream_seed(self, index: int, stream: int) -> int:
        """Seed of micro-step `index` on this rank for a stream (0 anchors, 1 noise).

        Re-seeding per step (instead of carrying RNG state) makes resume exact for any
        number of ranks, makes every rank's stream independent by construction, and lets
        the target stage run ahead in another thread without touching the noise stream.
        """
        # The global position of this micro-step's documents (rank r takes step
        # index * world + r of the epoch order), so a run with W ranks draws exactly the
        # anchors and noise of one process doing W micro-steps on the same data.
        global_index = index * self.world.world_size + self.world.rank
        base = self.cfg.training.seed * 10_000_019 + global_index
        return (base * 2 + stream) % (2**63)

    def _unit_weight(self, blocks: Any, st: StepSettings) -> torch.Tensor | None:
        """sum(w * valid) of a unit, as dflash_loss computes it (None for dpace)."""
        if st.weighting != "decay":
            return None
        valid = blocks.anchors.slot_valid_NB
        w = decay_weights(st.block_size, st.gamma, valid.device)[None, :] * valid
        return w.sum().float()

    def _lm_head_on_drafter(self) -> torch.Tensor:
        if self._lm_head is None:
            self._lm_head = self.target.lm_head_weight.to(self.world.drafter_device)
        return self._lm_head

    def _embed_on_drafter(self, ids: torch.Tensor) -> torch.Tensor:
        """Block embeddings on the drafter's GPU (a copy of the target's table in pairs)."""
        if self._embed_table is None:
            emb = self.target.model.get_input_embeddings().weight.detach()
            self._embed_table = emb.to(self.world.drafter_device)
        return self._embed_table[ids.to(self._embed_table.device)]

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

    def _target_stage(self, micro_index: int, pos: Position) -> _Staged:
        """Target forward + anchors + labels of one micro-step (any thread)."""
        t = self.cfg.training
        tdev, ddev = self.world.target_device, self.world.drafter_device
        self.anchor_gen.manual_seed(self._stream_seed(micro_index, 0))
        t0 = time.perf_counter()
        docs, trunc = self._documents(pos)
        # pack_documents=false is the unpacked baseline: one drafter forward per
        # document (anchors shared out by length), for benchmarks only.
        units = [docs] if t.pack_documents else [[d] for d in docs]
        total_len = sum(int(d[0].numel()) for d in docs)
        staged = []
        for unit in units:
            settings = self.settings
            if len(units) > 1:
                share = sum(int(d[0].numel()) for d in unit) / total_len
                settings = dataclasses.replace(
                    settings, max_anchors=max(1, round(t.max_anchors * share))
                )
            tout = run_target(self.target, unit, settings)
            staged.append(
                (prepare_blocks(tout, self.target, settings, self.anchor_gen, ddev), settings)
            )
        _sync(tdev)
        return _Staged(micro_index, staged, trunc, time.perf_counter() - t0)

    def _next_staged(self, micro_index: int) -> _Staged:
        """The target stage of `micro_index`: computed now, or prefetched (pairs)."""
        if self.prefetch is None:
            st = self._target_stage(micro_index, self.position)
        else:
            st = self.prefetch.get(micro_index, self.position)
        self.position = self.batcher.advance(self.position)
        return st

    def train_step(self) -> StepStats:
        """One optimizer step (grad_accum_steps micro-steps): target stage, drafter stage."""
        if self.fast is not None:
            return StepStats(*self.fast.train_step())
        t = self.cfg.training
        ddev = self.world.drafter_device
        self.optimizer.zero_grad(set_to_none=True)
        target_s = drafter_s = 0.0
        tokens = truncated = 0
        loss_sum = 0.0
        agg: dict[str, torch.Tensor] = {}
        attn = self._attention()
        lm_head = self._lm_head_on_drafter()
        staged_all = []
        for micro in range(t.grad_accum_steps):
            index = self.step * t.grad_accum_steps + micro
            staged_all.append((index, self._next_staged(index)))
        # The step's loss is sum(w * l) / sum(w) over every supervised slot of every
        # micro-step on every rank: ranks and micro-steps count by their slot weight,
        # not equally. With decay weights the totals are known before the drafter runs
        # (one all-reduce per step); dpace weights depend on the drafter's own CE, so
        # then each micro-step is normalised on its own, across ranks.
        unit_w = [[self._unit_weight(b, st) for b, st in sd.units] for _, sd in staged_all]
        known = all(w is not None for ws in unit_w for w in ws)
        total_w = None
        if known:
            local = torch.stack([w for ws in unit_w for w in ws if w is not None]).sum()
            total_w = D.all_reduce_sum(local, self.world).clamp(min=1e-12)
        n_units = sum(len(sd.units) for _, sd in staged_all)
        for (index, staged), weights in zip(staged_all, unit_w):
            target_s += staged.seconds
            truncated += staged.truncated
            # Noise is drawn on the drafter side only, from its own per-step seed.
            torch.manual_seed(self._stream_seed(index, 1))
            t1 = time.perf_counter()
            for (blocks, settings), w in zip(staged.units, weights):
                res = drafter_loss(
                    self.model,
                    blocks,
                    self._embed_on_drafter,
                    lm_head,
                    settings,
                    attn_fn=attn,
                    use_flex=self.compile,
                    autocast_dtype=self.autocast,
                )
                if total_w is not None and w is not None:
                    scale = self.world.world_size * w.to(res.loss.device) / total_w
                else:
                    local_w = res.metrics["weight_sum"].float()
                    global_w = D.all_reduce_sum(local_w, self.world).clamp(min=1e-12)
                    scale = self.world.world_size * local_w / global_w / n_units
                (res.loss * scale).backward()
                tokens += blocks.pack.num_tokens
                loss_sum += float(res.loss.detach()) / n_units
                for k, v in res.metrics.items():
                    agg[k] = agg.get(k, 0) + v.float() / n_units
            _sync(ddev)
            drafter_s += time.perf_counter() - t1

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
                if self.cfg.distributed.placement == "pairs" and self.prefetch is None:
                    # Warm-up done (compile, autotune) on this thread: now overlap.
                    self.prefetch = TargetPrefetcher(self)
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
                if t.eval_every and self.step % t.eval_every == 0:
                    self._in_training_eval()
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
            self._write_plots()
        finally:
            if self.prefetch is not None:
                self.prefetch.close()
            bar.close()
            self.metrics.close()
        return {"step": self.step, "stopped": False, "checkpoint": last_ckpt}

    def _log_window(self, window: list[StepStats]) -> dict[str, Any]:
        ok = [s for s in window if not s.skipped] or window
        n = len(ok)
        dt = sum(s.target_s + s.drafter_s for s in window)
        m = {k: sum(s.metrics[k] for s in ok) / n for k in ok[0].metrics}
        # tau is per block: weigh each step by its anchors (a step may have none).
        n_anchors = sum(float(s.metrics["anchors"]) for s in ok)
        if n_anchors > 0:
            m["exact_tau"] = (
                sum(s.metrics["exact_tau"] * s.metrics["anchors"] for s in ok) / n_anchors
            )
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

    def _in_training_eval(self) -> dict[str, Any] | None:
        """The real speculative loop on a few held-out prompts: measured tau, logged.

        Training accuracy can look fine while served acceptance is ~1; this measures
        the served number every eval_every steps, on rank 0 (others wait in the next
        collective).
        """
        if not self.world.is_main:
            return None
        if self.cfg.distributed.data_parallel == "fsdp" and self.world.distributed:
            self._log("in-training eval skipped: the drafter is FSDP-sharded")
            return None
        if self.target.sharded:
            # Rank 0 alone cannot run a target whose layers need every rank's all-gather.
            self._log("in-training eval skipped: the target is FSDP-sharded")
            return None
        from dflash_trainer.data.loading import load_tokenizer
        from dflash_trainer.eval.evaluate import evaluate_prompts
        from dflash_trainer.eval.prompts import load_prompt_set
        from dflash_trainer.train.dataset import tokenizer_spec

        ev = self.cfg.eval
        if not hasattr(self, "_eval_prompts"):
            self._tokenizer = load_tokenizer(tokenizer_spec(self.cfg.target))
            ps = load_prompt_set(ev.prompts[0], max_samples=ev.train_eval_samples, seed=ev.seed)
            self._eval_prompts = [p.messages for p in ps.prompts]
        t0 = time.perf_counter()
        out = evaluate_prompts(self.drafter, self.target, self._tokenizer, self._eval_prompts, ev)
        rec: dict[str, Any] = {
            "step": self.step,
            "eval_set": ev.prompts[0],
            "eval_tau": float(out["tau"]),
            "eval_tau_pooled": float(out["tau_pooled"]),
            "eval_time_s": time.perf_counter() - t0,
        }
        msg = f"step {self.step}: measured tau on {ev.prompts[0]} = {rec['eval_tau']:.2f}"
        walk = self._heldout_walk()
        if walk is not None:
            rec.update(heldout_walk_tau=walk["tau"], heldout_walk_time_s=walk["seconds"])
            msg += f", walked held-out tau = {walk['tau']:.2f} ({walk['documents']:.0f} documents)"
        self.metrics.write(rec)
        self._log(msg)
        self.drafter.train()
        return rec

    def _heldout_walk(self) -> dict[str, float] | None:
        """The held-out split walked as greedy serving walks it (walk_eval.py), or None.

        The in-batch tau's served counterpart on the training distribution: uniform anchors
        overstate what serving, which counts tokens per step, will see.
        """
        n = self.cfg.eval.train_walk_docs
        held_out = self.data.eval
        if not n or held_out is None:
            return None
        from dflash_trainer.eval.walk import walked_tau

        t0 = time.perf_counter()
        docs = [held_out[i] for i in range(min(n, len(held_out)))]
        # Each answer is walked over its first eval.max_new_tokens tokens, the length the
        # served eval measures (and a bound on the walk's cost for long documents).
        out = walked_tau(self.drafter, self.target, docs, self.cfg.eval.max_new_tokens)
        out["seconds"] = time.perf_counter() - t0
        return out

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

    def _sharded(self) -> bool:
        return self.world.distributed and self.cfg.distributed.data_parallel == "fsdp"

    def _full_states(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """Unsharded model and optimizer state (a collective under FSDP: every rank calls)."""
        if not self._sharded():
            return self.drafter.state_dict(), self.optimizer.state_dict()
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_model_state_dict,
            get_optimizer_state_dict,
        )

        opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
        model_sd: Any = get_model_state_dict(self.model, options=opts)
        optim_sd: Any = get_optimizer_state_dict(self.model, self.optimizer, options=opts)
        return model_sd, optim_sd

    def save_checkpoint(self) -> str | None:
        state, optim_state = self._full_states()
        if not self.world.is_main:
            D.broadcast_object(None, self.world)
            return None
        if not all(bool(torch.isfinite(v).all()) for v in state.values()):
            raise DFlashError(
                f"step {self.step}: the drafter has non-finite weights; refusing to overwrite "
                f"the last good checkpoint ({self.checkpointer.latest() or 'none'})"
            )
        # Anchors and noise are re-seeded per step (_stream_seed); the generator
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
            optim_state,
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
        if self._sharded():
            from torch.distributed.checkpoint.state_dict import (
                StateDictOptions,
                set_model_state_dict,
                set_optimizer_state_dict,
            )

            opts = StateDictOptions(full_state_dict=True)
            full: Any = data.drafter_state
            set_model_state_dict(self.model, full, options=opts)
            set_optimizer_state_dict(self.model, self.optimizer, data.optimizer_state, options=opts)
        else:
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
        state, _ = self._full_states()
        if not self.world.is_main:
            return
        from dflash_trainer.formats.drafter_io import save_drafter_files

        save_drafter_files(self.run_dir / "drafter", self.spec, state, self._meta())
        self._log(f"final drafter written to {self.run_dir / 'drafter'}")

    def _write_plots(self) -> None:
        if not self.world.is_main:
            return
        from dflash_trainer.train.plots import plot_run

        try:
            plot_run(self.run_dir)
        except (DFlashError, ImportError, OSError) as e:
            self._log(f"plots not written: {e}")

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
