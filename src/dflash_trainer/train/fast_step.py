"""The fast training step: fixed shapes, the target in CUDA graphs, no host waits in a step.

A small target (SmolLM2-135M: a ~2 TFLOP forward per 8k tokens) trains launch-bound on
the standard step: every `.item()`, `nonzero` and host-built mask makes the host wait
for the GPU and then launch the next few hundred small kernels while the GPU idles. The
fast step does the same work with the same numbers, arranged so the host runs ahead:

- the host half (pack, anchors, block inputs, mask intervals, the target's row layout;
  fast_layout.py) is a pure function of the step's documents and seed, prepared one
  micro-step ahead in a background thread;
- the target runs on fixed [R, L] chunks (several documents per row, block-diagonal
  mask), each chunk shape captured once as a CUDA graph that writes the tapped features
  straight into a fixed [T, F] pack buffer;
- the drafter sees a pack of fixed length T, N fixed anchors (zero-weight padding) and a
  BlockMask built on the GPU from fixed-size intervals; the loss goes through all N*B
  slots (fast_loss.py);
- a non-finite step is skipped on the GPU (the fused AdamW's `found_inf`, as AMP does);
- the next step's target stage is queued before this step's metrics are read (one small
  copy per step), so the GPU always has queued work while the host turns around.

On CPU the same code runs eagerly (no graphs): tests check it against the standard step.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from dflash_trainer.config import Config
from dflash_trainer.core.dflash2 import CandidateSelector
from dflash_trainer.core.loss import DFlash2Inputs
from dflash_trainer.core.masks import Intervals, build_block_mask, intervals_to_dense
from dflash_trainer.errors import DFlashError
from dflash_trainer.target.model import FrozenTarget
from dflash_trainer.train.batching import Position
from dflash_trainer.train.distributed import unwrap
from dflash_trainer.train.fast_layout import (
    AUTO_MAX_TARGET_PARAMS,
    HostStep,
    fast_shapes,
    prepare_host,
)
from dflash_trainer.train.fast_loss import fixed_shape_loss
from dflash_trainer.train.fast_target import TargetRunner
from dflash_trainer.train.step import StepSettings, settings_for_spec

Trainer = Any
"""train.trainer.Trainer (not imported: it imports this module)."""


class StepNumbers(NamedTuple):
    """The fields of `trainer.StepStats`, in its order."""

    loss: float
    metrics: dict[str, torch.Tensor]
    grad_norm: float
    skipped: bool
    target_s: float
    drafter_s: float
    tokens: int
    truncated: int


def fast_blockers(cfg: Config, target: FrozenTarget, world_size: int) -> str | None:
    """Why this run cannot take the fast step, or None."""
    d, t = cfg.distributed, cfg.training
    if world_size > 1:
        return f"{world_size} ranks (the fast step runs in one process)"
    if d.placement != "colocated":
        return f"distributed.placement={d.placement} (the fast step is colocated)"
    if not t.pack_documents:
        return "training.pack_documents=false"
    if target.sharded or len({p.device for p in target.model.parameters()}) > 1:
        return "the target is sharded or spread over devices"
    tc = target.model.config.get_text_config()
    types = set(getattr(tc, "layer_types", None) or ["full_attention"])
    if types != {"full_attention"}:
        return f"target layer types {sorted(types)} (the block-diagonal rows need full attention)"
    if getattr(tc, "sliding_window", None) and getattr(tc, "use_sliding_window", True):
        return f"target sliding_window={tc.sliding_window}"
    impl = getattr(target.model.config, "_attn_implementation", None) or "sdpa"
    if impl not in ("sdpa", "eager"):
        return f"target attn_implementation={impl} (the fast step passes a 4D mask)"
    return None


def resolve_step_path(
    cfg: Config, target: FrozenTarget, world_size: int, device: torch.device
) -> tuple[str, str]:
    """("fast" | "standard", why): the step this run takes."""
    mode = cfg.training.step_path
    if mode == "standard":
        return "standard", "training.step_path=standard"
    why = fast_blockers(cfg, target, world_size)
    if mode == "fast":
        if why is not None:
            raise DFlashError(
                f"training.step_path=fast: {why}; use training.step_path=standard or auto"
            )
        return "fast", "training.step_path=fast"
    params = target.num_params
    size = f"{params / 1e6:.0f}M-parameter target"
    if device.type != "cuda":
        return "standard", "auto: not on a GPU"
    if why is not None:
        return "standard", f"auto: {why}"
    if params >= AUTO_MAX_TARGET_PARAMS:
        return "standard", f"auto: {size}, compute-bound (fast under {AUTO_MAX_TARGET_PARAMS:.0e})"
    return (
        "fast",
        f"auto: {size} on {device.type}, launch-bound (fast under {AUTO_MAX_TARGET_PARAMS:.0e})",
    )


@dataclass
class _TargetOut:
    index: int
    features_TF: torch.Tensor
    labels_NB: torch.Tensor | None
    target_hidden_NBH: torch.Tensor | None
    seconds: Callable[[], float]
    """Target stage time, readable once the step's results are in."""


class FastStep:
    """`Trainer.train_step` for the fast path: same data, anchors, noise, loss and update."""

    def __init__(self, trainer: Trainer, graphs: bool) -> None:
        self.tr = trainer
        cfg = trainer.cfg
        # The trainer's own settings, always with fixed shapes (block size and mask from the spec).
        self.st: StepSettings = settings_for_spec(cfg, trainer.spec, True)
        self.shapes = fast_shapes(
            self.st, cfg.data.doc_limit, True, cfg.training.target_chunk_tokens
        )
        spec = trainer.spec
        self.windows = {
            kind: spec.sliding_window if kind == "sliding_attention" else None
            for kind in dict.fromkeys(spec.layer_types)
        }
        self.dev = trainer.world.drafter_device
        self.cuda = self.dev.type == "cuda"
        need_final = self.st.labels == "target"
        flex = cfg.training.target_attention == "flex"
        self.runner = TargetRunner(trainer.target, self.shapes, need_final, graphs, flex)
        # The host half runs one micro-step ahead in one thread (CUDA only: on CPU it
        # would compete with the step for the same cores).
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="dflash-host") if self.cuda else None
        self.futures: dict[int, Future[HostStep]] = {}
        self.ahead: tuple[HostStep, _TargetOut] | None = None
        self.last_return: float | None = None
        self.capture_reported = False

    def describe(self) -> str:
        s = self.shapes
        graphs = "CUDA graphs" if self.runner.graphs else "eager"
        if self.runner.flex:
            target = "the target over the whole pack, target attention flex"
        else:
            target = f"target rows {list(s.row_lengths)} x {s.chunk_tokens} tokens a chunk"
        return f"pack {s.ctx_len} tokens, {s.anchors} anchors, {target}, {graphs}"

    # ------------------------------------------------------------------ host half

    def _prepare(self, index: int, pos: Position) -> HostStep:
        tr = self.tr
        docs, truncated = tr._documents(pos)
        gen = torch.Generator().manual_seed(tr._stream_seed(index, 0))
        hs = prepare_host(
            index, docs, truncated, self.st, self.shapes, self.windows, gen, self.runner.flex
        )
        return hs.pin() if self.cuda else hs

    def host_step(self, index: int, pos: Position) -> HostStep:
        """Micro-step `index` at data position `pos` (prefetched), and start on the next."""
        fut = self.futures.pop(index, None)
        hs = fut.result() if fut is not None else self._prepare(index, pos)
        nxt = index + 1
        if self.pool is not None and nxt not in self.futures:
            self.futures = {nxt: self.pool.submit(self._prepare, nxt, self.tr.batcher.advance(pos))}
        return hs

    # ------------------------------------------------------------------ device half

    def _to(self, t: torch.Tensor) -> torch.Tensor:
        return t.to(self.dev, non_blocking=True)

    def target_stage(self, hs: HostStep) -> _TargetOut:
        """Target chunks, then the slot labels (all N*B slots: fixed shape)."""
        tgt = self.tr.target
        clock = _Clock(self.cuda)
        self.runner.run(hs.chunks)
        pred = hs.pred_idx_NB.to(tgt.device, non_blocking=True)
        labels = th = None
        if self.st.labels == "data":
            assert hs.data_labels_NB is not None
            labels = self._to(hs.data_labels_NB)
        else:
            assert self.runner.final is not None
            rows = self.runner.final[pred.reshape(-1)]
            if self.st.target_distribution:
                th = self._to(rows.view(*pred.shape, -1))
            else:
                labels = self._to(tgt.argmax_at(rows).view(pred.shape))
        feats = self.runner.feat[: self.shapes.ctx_len]
        return _TargetOut(hs.index, self._to(feats), labels, th, clock.stop())

    def drafter_stage(self, hs: HostStep, tout: _TargetOut, scale: float) -> Any:
        """Drafter forward over the fixed pack, the fixed-shape loss, and its backward."""
        tr, st = self.tr, self.st
        n, b = hs.valid_NB.shape
        kv_len = self.shapes.ctx_len + n * b
        masks = {}
        for kind, parts in hs.intervals.items():
            lo, hi, blo, bhi = (self._to(p) for p in parts)
            iv = Intervals(lo, hi, blo, bhi, kv_len)
            masks[kind] = build_block_mask(iv) if tr.compile else intervals_to_dense(iv)
        block_ids = self._to(hs.block_ids_NB)
        emb = tr._embed_on_drafter(block_ids.reshape(-1)).detach()
        # Noise is drawn from the micro-step's own seed, as in the standard step.
        torch.manual_seed(tr._stream_seed(hs.index, 1))
        dt = tr.autocast
        ctx = (
            torch.autocast(self.dev.type, dtype=dt)
            if dt
            else torch.autocast(self.dev.type, enabled=False)
        )
        with ctx:
            feats = tout.features_TF if dt is not None else tout.features_TF.float()
            if dt is None:
                emb = emb.float()
            hidden = tr.model(
                feats,
                self._to(hs.ctx_pos_T),
                emb,
                self._to(hs.block_pos_NB).reshape(-1),
                masks,
                tr._attention(),
            )
            hidden = hidden.view(n, b, -1)
            selector = getattr(unwrap(tr.model), "candidate_selector", None)
            d2 = None
            if isinstance(selector, CandidateSelector):
                d2 = DFlash2Inputs(selector, block_ids[:, 0], hidden)
            res = fixed_shape_loss(
                hidden,
                tr._lm_head_on_drafter(),
                self._to(hs.valid_NB),
                self._to(hs.real_N),
                labels_NB=tout.labels_NB,
                target_hidden_NBH=tout.target_hidden_NBH,
                objective=st.objective(),
                dflash2=d2,
            )
        (res.loss * scale).backward()
        return res

    def optimizer_stage(self, loss_sum: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Clip, then step unless the loss or the gradient is non-finite: (grad norm, finite)."""
        t, opt = self.tr.cfg.training, self.tr.optimizer
        grad_norm = torch.nn.utils.clip_grad_norm_(
            self.tr.model.parameters(), t.grad_clip if t.grad_clip > 0 else float("inf")
        )
        finite = torch.isfinite(loss_sum) & torch.isfinite(grad_norm)
        if opt.defaults.get("fused"):
            # The fused kernel skips the whole update (and its step count) when found_inf
            # is set, on the GPU: no host read decides it.
            opt.found_inf = (~finite).float()
            try:
                opt.step()
            finally:
                del opt.found_inf
        elif bool(finite):  # an unfused optimizer (CPU): the host read costs nothing there
            opt.step()
        return grad_norm, finite

    # ------------------------------------------------------------------ one step

    def _target_for(self, hs: HostStep) -> _TargetOut:
        if self.ahead is not None and self.ahead[0].index == hs.index:
            tout = self.ahead[1]
            self.ahead = None
            return tout
        return self.target_stage(hs)

    def train_step(self) -> StepNumbers:
        """One optimizer step; updates the trainer's counters exactly as its own step does."""
        tr, t = self.tr, self.tr.cfg.training
        start = self.last_return if self.last_return is not None else time.perf_counter()
        tr.optimizer.zero_grad(set_to_none=True)
        micro: list[HostStep] = []
        for m in range(t.grad_accum_steps):
            index = tr.step * t.grad_accum_steps + m
            if self.ahead is not None and self.ahead[0].index == index:
                micro.append(self.ahead[0])
            else:
                micro.append(self.host_step(index, tr.position))
            tr.position = tr.batcher.advance(tr.position)
        # The loss is sum(w * l) / sum(w) over every slot of the step: with decay weights
        # the micro-steps' weights are known on the host; dpace normalises each on its own.
        weights = [hs.unit_weight for hs in micro]
        total_w = max(sum(w for w in weights if w is not None), 1e-12)
        n = len(micro)
        loss_sum = torch.zeros((), device=self.dev)
        agg: dict[str, torch.Tensor] = {}
        target_s: list[Callable[[], float]] = []
        for hs, w in zip(micro, weights):
            tout = self._target_for(hs)
            target_s.append(tout.seconds)
            res = self.drafter_stage(hs, tout, w / total_w if w is not None else 1.0 / n)
            loss_sum = loss_sum + res.loss.detach().float() / n
            for k, v in res.metrics.items():
                agg[k] = agg.get(k, 0) + v.float() / n
        grad_norm, finite = self.optimizer_stage(loss_sum)
        read = _StatsRead([loss_sum, grad_norm.float(), finite.float()], agg, self.cuda)
        if tr.step + 1 < tr.total_steps:
            # Queue the next step's target before waiting on this step's numbers.
            nxt = self.host_step(micro[-1].index + 1, tr.position)
            self.ahead = (nxt, self.target_stage(nxt))
        (loss, norm, ok), metrics = read.result()
        return self._finish(micro, loss, norm, ok > 0, metrics, target_s, start)

    def _finish(
        self,
        micro: list[HostStep],
        loss: float,
        grad_norm: float,
        finite: bool,
        metrics: dict[str, torch.Tensor],
        target_s: list[Callable[[], float]],
        start: float,
    ) -> StepNumbers:
        tr = self.tr
        if self.runner.capture_failed and not self.capture_reported:
            self.capture_reported = True
            tr._log(f"target graph capture failed ({self.runner.capture_failed}); running eagerly")
        if finite:
            tr.bad_steps = 0
        else:
            tr.bad_steps += 1
            tr.skipped_total += 1
        tr.scheduler.step()
        tr.step += 1
        tokens = sum(hs.tokens for hs in micro)
        truncated = sum(hs.truncated for hs in micro)
        tr.tokens_seen += tokens
        tr.truncated_total += truncated
        now = time.perf_counter()
        self.last_return = now
        tgt = sum(f() for f in target_s)
        # Stages overlap (the next target runs while the host reads this step), so the
        # wall time of the step is split as: the target's GPU time, the rest.
        wall = now - start
        return StepNumbers(
            loss, metrics, grad_norm, not finite, tgt, max(0.0, wall - tgt), tokens, truncated
        )

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=True, cancel_futures=True)


class _Clock:
    """Elapsed time of a stage: CUDA events (read later, no wait now) or the host clock."""

    def __init__(self, cuda: bool) -> None:
        self.cuda = cuda
        self.t0 = time.perf_counter()
        if cuda:
            self.e0 = torch.cuda.Event(enable_timing=True)
            self.e1 = torch.cuda.Event(enable_timing=True)
            self.e0.record()

    def stop(self) -> Callable[[], float]:
        if not self.cuda:
            dt = time.perf_counter() - self.t0
            return lambda: dt
        self.e1.record()
        return lambda: self.e0.elapsed_time(self.e1) / 1e3


class _StatsRead:
    """The step's scalars and metrics in one device-to-host copy, waited on later."""

    def __init__(
        self, scalars: list[torch.Tensor], metrics: dict[str, torch.Tensor], cuda: bool
    ) -> None:
        self.keys = list(metrics)
        self.shapes = [metrics[k].shape for k in self.keys]
        parts = [s.reshape(-1) for s in scalars] + [metrics[k].reshape(-1) for k in self.keys]
        vec = torch.cat([p.float() for p in parts])
        self.n_scalars = len(scalars)
        self.event: torch.cuda.Event | None = None
        if cuda:
            self.host = torch.empty(vec.shape, dtype=vec.dtype, pin_memory=True)
            self.host.copy_(vec, non_blocking=True)
            self.event = torch.cuda.Event()
            self.event.record()
        else:
            self.host = vec

    def result(self) -> tuple[list[float], dict[str, torch.Tensor]]:
        if self.event is not None:
            self.event.synchronize()
        vals = self.host.clone()
        scalars = vals[: self.n_scalars].tolist()
        out: dict[str, torch.Tensor] = {}
        at = self.n_scalars
        for k, shape in zip(self.keys, self.shapes):
            size = int(torch.Size(shape).numel())
            out[k] = vals[at : at + size].view(shape)
            at += size
        return scalars, out


def build_fast_step(trainer: Trainer) -> tuple[FastStep | None, str]:
    """The fast step for this trainer (None: the standard step) and the log line saying why."""
    w = trainer.world
    path, why = resolve_step_path(trainer.cfg, trainer.target, w.world_size, w.drafter_device)
    if path == "standard":
        unused = trainer.cfg.training.target_attention == "flex"
        note = "; training.target_attention=flex applies to the fast step only" if unused else ""
        return None, f"step path: standard ({why}){note}"
    fast = FastStep(trainer, graphs=w.drafter_device.type == "cuda")
    return fast, f"step path: fast ({why}; {fast.describe()})"
