"""The stages of one optimizer step, as methods the Trainer inherits.

    documents -> target stage (target forward, anchors, labels)    `_target_stage`
              -> drafter stage (forward + backward per unit)       `_drafter_stage`
              -> clip, then step or skip                           `_finish_step`

`train_step` runs them for grad_accum_steps micro-steps; with `pairs`, the target stage
of the next micro-step runs ahead in one thread (`TargetPrefetcher`).
"""

from __future__ import annotations

import dataclasses
import math
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from dflash_trainer.config import Config
from dflash_trainer.core.drafter import DFlashDrafter, flex_attention_eager, sdpa_attention
from dflash_trainer.core.loss import decay_slot_weights
from dflash_trainer.target.model import FrozenTarget
from dflash_trainer.train import distributed as D
from dflash_trainer.train.batching import Position, TokenBudgetBatcher
from dflash_trainer.train.dataset import TrainData
from dflash_trainer.train.step import StepSettings, drafter_loss, prepare_blocks, run_target


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
    empty: bool = False
    """No supervised slot in the step's anchors on any rank: skipped, schedule kept."""


@dataclass
class _StepAccum:
    """What the micro-steps of one optimizer step add up."""

    n_units: int
    total_w: torch.Tensor | None = None
    """Decay weighting: sum(w) over the step's units on every rank, known up front."""
    dpace_w: torch.Tensor | float = 0.0
    """D-PACE weighting: the same sum, gathered unit by unit as the drafter runs."""
    target_s: float = 0.0
    drafter_s: float = 0.0
    tokens: int = 0
    truncated: int = 0
    loss_sum: float = 0.0
    agg: dict[str, torch.Tensor] = field(default_factory=dict)


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
    no autotuner or compile cache is ever used by two threads at once (two threads in one
    FLA/Triton autotuner crash it). The data order is the batcher's, so results equal the
    sequential path.
    """

    def __init__(self, trainer: Stepper) -> None:
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


class Stepper:
    """The step methods of `Trainer` (train/trainer.py builds every attribute below)."""

    cfg: Config
    world: D.World
    compile: bool
    fixed_shapes: bool
    drafter: DFlashDrafter
    model: torch.nn.Module
    target: FrozenTarget
    settings: StepSettings
    autocast: torch.dtype | None
    anchor_gen: torch.Generator
    batcher: TokenBudgetBatcher
    data: TrainData
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    prefetch: TargetPrefetcher | None
    position: Position
    step: int
    micro_steps: int
    bad_steps: int
    skipped_total: int
    truncated_total: int
    tokens_seen: int
    _attn_fn: Any
    _lm_head: torch.Tensor | None
    _embed_table: torch.Tensor | None

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
        """sum(w * valid) of a unit, with dflash_loss's own weights (None for dpace)."""
        if st.weighting != "decay":
            return None
        return decay_slot_weights(blocks.anchors.slot_valid_NB, st.gamma).sum()

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
        """One optimizer step (grad_accum_steps micro-steps): target stage, drafter stage.

        A step whose anchors have no supervised slot on any rank teaches nothing: it is
        skipped (`StepStats.empty`) without using up a step of the schedule.
        """
        t = self.cfg.training
        self.optimizer.zero_grad(set_to_none=True)
        staged_all = []
        for _ in range(t.grad_accum_steps):
            staged_all.append((self.micro_steps, self._next_staged(self.micro_steps)))
            self.micro_steps += 1
        # The step's loss is sum(w * l) / sum(w) over every supervised slot of every
        # micro-step on every rank: ranks and micro-steps count by their slot weight,
        # not equally. With decay weights the totals are known before the drafter runs
        # (one all-reduce per step); dpace weights depend on the drafter's own CE, so
        # then each micro-step is normalised on its own, across ranks.
        unit_w = [[self._unit_weight(b, st) for b, st in sd.units] for _, sd in staged_all]
        acc = _StepAccum(n_units=sum(len(sd.units) for _, sd in staged_all))
        if all(w is not None for ws in unit_w for w in ws):
            local = torch.stack([w for ws in unit_w for w in ws if w is not None]).sum()
            acc.total_w = D.all_reduce_sum(local, self.world)
        for (index, staged), weights in zip(staged_all, unit_w):
            self._drafter_stage(index, staged, weights, acc)
        return self._finish_step(acc)

    def _drafter_stage(
        self, index: int, staged: _Staged, weights: list[torch.Tensor | None], acc: _StepAccum
    ) -> None:
        """Drafter forward + backward of one micro-step's units, accumulated into `acc`."""
        acc.target_s += staged.seconds
        acc.truncated += staged.truncated
        # Noise is drawn on the drafter side only, from its own per-step seed.
        torch.manual_seed(self._stream_seed(index, 1))
        t1 = time.perf_counter()
        for (blocks, settings), w in zip(staged.units, weights):
            res = drafter_loss(
                self.model,
                blocks,
                self._embed_on_drafter,
                self._lm_head_on_drafter(),
                settings,
                attn_fn=self._attention(),
                use_flex=self.compile,
                autocast_dtype=self.autocast,
            )
            if acc.total_w is not None and w is not None:
                total = acc.total_w.clamp(min=1e-12)
                scale = self.world.world_size * w.to(res.loss.device) / total
            else:
                local_w = res.metrics["weight_sum"].float()
                global_w = D.all_reduce_sum(local_w, self.world)
                acc.dpace_w = acc.dpace_w + global_w
                scale = self.world.world_size * local_w / global_w.clamp(min=1e-12) / acc.n_units
            (res.loss * scale).backward()
            acc.tokens += blocks.pack.num_tokens
            acc.loss_sum += float(res.loss.detach()) / acc.n_units
            for k, v in res.metrics.items():
                acc.agg[k] = acc.agg.get(k, 0) + v.float() / acc.n_units
        _sync(self.world.drafter_device)
        acc.drafter_s += time.perf_counter() - t1

    def _finish_step(self, acc: _StepAccum) -> StepStats:
        """Clip, then step the optimizer, or skip a non-finite or unsupervised step."""
        t = self.cfg.training
        grad_norm = torch.nn.utils.clip_grad_norm_(
            self.model.parameters(), t.grad_clip if t.grad_clip > 0 else float("inf")
        )
        if hasattr(grad_norm, "full_tensor"):  # FSDP returns the norm as a DTensor
            grad_norm = grad_norm.full_tensor()
        weight = acc.total_w if acc.total_w is not None else acc.dpace_w
        # One host sync for both checks (the weight sum is already on the device).
        finite_grad, supervised = torch.stack(
            [torch.isfinite(grad_norm), torch.as_tensor(weight).to(grad_norm.device) > 0]
        ).tolist()
        finite = math.isfinite(acc.loss_sum) and bool(finite_grad)
        empty = not supervised and finite
        self.tokens_seen += acc.tokens
        self.truncated_total += acc.truncated
        if empty:
            self.optimizer.zero_grad(set_to_none=True)
            self.skipped_total += 1
        else:
            if finite:
                self.optimizer.step()
                self.bad_steps = 0
            else:
                self.optimizer.zero_grad(set_to_none=True)
                self.bad_steps += 1
                self.skipped_total += 1
            self.scheduler.step()
            self.step += 1
        return StepStats(
            acc.loss_sum,
            acc.agg,
            float(grad_norm),
            not finite or empty,
            acc.target_s,
            acc.drafter_s,
            acc.tokens,
            acc.truncated,
            empty=empty,
        )
