"""Packed tokens/s of the standard training step and the fast one, same run, same documents.

Both paths train the SmolLM2-135M recipe's drafter through the real Trainer (optimizer
step included) on the same document source: the baseline at the recipe's geometry
(8,192 tokens and 512 anchors a step), the fast step (training.step_path=fast) at a
larger token budget with the same anchor density. Then one extra step of each is run
stage by stage, with CUDA events, for the breakdown:

    target           target forward (and, fast, the slot labels)
    pack_anchors     standard: packing, anchors, labels after the target; fast: the host
                     half (pack, anchors, intervals, row layout), CPU time that normally
                     runs in a background thread during the previous step
    drafter          BlockMask, drafter forward, loss, backward
    optimizer        clipping and AdamW
    host             step wall time not covered by the stages' GPU time

    # H200 (< 4 min), real token ids from a prepared dataset if given:
    python benchmarks/train_speed.py --out train_speed.json [--data PREPARED_DIR]
    # a third leg: the fast step with the target's attention through FlexAttention
    # (training.target_attention=flex), against the dense-mask fast step of the same run:
    python benchmarks/train_speed.py --out train_speed.json --data PREPARED_DIR --flex-target
    # CPU smoke test (a tiny random llama):
    python benchmarks/train_speed.py --device cpu --tiny --out /tmp/train_speed.json
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from dflash_trainer.config import Config, config_from_dict, load_config
from dflash_trainer.train.dataset import TrainData
from dflash_trainer.train.step import drafter_loss, prepare_blocks, run_target
from dflash_trainer.train.trainer import Trainer

RECIPE = "smollm2-135m"


@dataclass
class _Doc:
    input_ids: np.ndarray
    loss_mask: np.ndarray


class SyntheticDocs:
    """Random token ids with ShareGPT-like lengths (log-normal, mean ~270, capped).

    Regenerated ShareGPT for SmolLM2 holds 2.89M tokens in 10,516 documents (mean 275);
    the first ~30% of each document (the prompt) is unsupervised.
    """

    def __init__(self, n: int, vocab: int, mask_id: int, cap: int, seed: int = 0) -> None:
        rng = np.random.default_rng(seed)
        raw = rng.lognormal(np.log(190.0), 0.85, n)
        self._lengths = np.clip(raw.round(), 16, cap).astype(np.int64)
        self.vocab, self.mask_id, self.seed = vocab, mask_id, seed

    @property
    def lengths(self) -> np.ndarray:
        return self._lengths

    def __len__(self) -> int:
        return len(self._lengths)

    def __getitem__(self, i: int) -> _Doc:
        n = int(self._lengths[i])
        rng = np.random.default_rng([self.seed, i])
        ids = rng.integers(0, self.vocab, n).astype(np.int32)
        ids[ids == self.mask_id] = 0
        mask = np.zeros(n, dtype=bool)
        mask[int(0.3 * n) :] = True
        return _Doc(ids, mask)


def tiny_target(path: Path) -> Path:
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model(
        "llama",
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=128,
        max_position_embeddings=2048,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(path)
    return path


def tiny_config(tmp: Path, device: str) -> dict[str, Any]:
    return {
        "target": {"name_or_path": str(tiny_target(tmp / "target")), "dtype": "float32"},
        "drafter": {
            "num_layers": 2,
            "block_size": 4,
            "num_target_layers": 2,
            "mask_token_id": 127,
            "geometry": None,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 16,
        },
        "data": {"token_budget": 512, "max_doc_tokens": 256},
        "training": {"max_anchors": 32, "precision": "fp32", "device": device},
    }


def make_config(
    args: argparse.Namespace,
    base: dict[str, Any] | None,
    fast: bool,
    run: Path,
    extra: tuple[str, ...] = (),
) -> Config:
    budget = args.fast_budget if fast else args.base_budget
    over = [
        *extra,
        f"run.output_dir={run}",
        f"training.device={args.device}",
        f"training.step_path={'fast' if fast else 'standard'}",
        "training.max_steps=100000",
        "training.eval_every=0",
        f"data.token_budget={budget}",
        f"training.max_anchors={max(1, round(args.base_anchors * budget / args.base_budget))}",
    ]
    if fast:
        over.append(f"training.loss_chunk_rows={args.fast_chunk_rows}")
    if base is None:
        return load_config(recipe=RECIPE, overrides=over)
    from dflash_trainer.config import apply_overrides

    return config_from_dict(apply_overrides(json.loads(json.dumps(base)), over))


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


class Stages:
    """Stage times of one step: CUDA events on a GPU (host clock on CPU), read at the end."""

    def __init__(self, dev: torch.device) -> None:
        self.cuda = dev.type == "cuda"
        self.marks: list[tuple[str, Any]] = []
        self.host: dict[str, float] = {}

    def mark(self, name: str) -> None:
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            self.marks.append((name, ev))
        else:
            self.marks.append((name, time.perf_counter()))

    def result(self) -> dict[str, float]:
        out = dict(self.host)
        for (_, a), (name, b) in zip(self.marks, self.marks[1:]):
            out[name] = a.elapsed_time(b) if self.cuda else (b - a) * 1e3
        return out


def baseline_breakdown(tr: Trainer) -> dict[str, float]:
    """One standard step, stage by stage (the same calls as Trainer.train_step)."""
    dev = tr.world.drafter_device
    st, index, pos = tr.settings, tr.step, tr.position
    tr.optimizer.zero_grad(set_to_none=True)
    _sync(dev)
    s = Stages(dev)
    t0 = time.perf_counter()
    s.mark("start")
    tr.anchor_gen.manual_seed(tr._stream_seed(index, 0))
    docs, _ = tr._documents(pos)
    tout = run_target(tr.target, docs, st)
    s.mark("target")
    blocks = prepare_blocks(tout, tr.target, st, tr.anchor_gen, dev)
    s.mark("pack_anchors")
    torch.manual_seed(tr._stream_seed(index, 1))
    res = drafter_loss(
        tr.model,
        blocks,
        tr._embed_on_drafter,
        tr._lm_head_on_drafter(),
        st,
        attn_fn=tr._attention(),
        use_flex=tr.compile,
        autocast_dtype=tr.autocast,
    )
    res.loss.backward()
    float(res.loss.detach())
    s.mark("drafter")
    norm = torch.nn.utils.clip_grad_norm_(tr.model.parameters(), tr.cfg.training.grad_clip)
    bool(torch.isfinite(norm))
    tr.optimizer.step()
    s.mark("optimizer")
    _sync(dev)
    out = s.result()
    out["step_wall"] = (time.perf_counter() - t0) * 1e3
    return out


def fast_breakdown(tr: Trainer) -> dict[str, float]:
    """One fast step, stage by stage (FastStep's own stage functions)."""
    fast = tr.fast
    assert fast is not None
    dev = tr.world.drafter_device
    tr.optimizer.zero_grad(set_to_none=True)
    _sync(dev)
    t0 = time.perf_counter()
    hs = fast._prepare(tr.step, tr.position)
    prep_ms = (time.perf_counter() - t0) * 1e3
    s = Stages(dev)
    t1 = time.perf_counter()
    s.mark("start")
    tout = fast.target_stage(hs)
    s.mark("target")
    res = fast.drafter_stage(hs, tout, 1.0)
    s.mark("drafter")
    fast.optimizer_stage(res.loss.detach())
    s.mark("optimizer")
    _sync(dev)
    out = s.result()
    out["pack_anchors"] = prep_ms
    out["step_wall"] = (time.perf_counter() - t1) * 1e3
    return out


def measure(tr: Trainer, args: argparse.Namespace, fast: bool) -> dict[str, Any]:
    dev = tr.world.drafter_device
    warm = args.warmup
    # Graphs are captured per new chunk shape: warm up until a few steps add none.
    quiet = 0
    for i in range(args.max_warmup if fast else warm):
        before = len(tr.fast.runner.static) if tr.fast is not None else 0
        tr.train_step()
        after = len(tr.fast.runner.static) if tr.fast is not None else 0
        quiet = quiet + 1 if after == before else 0
        if i + 1 >= warm and (not fast or quiet >= 3):
            break
    _sync(dev)
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
    tokens = steps = 0
    losses = []
    t0 = time.perf_counter()
    while steps < args.min_steps or time.perf_counter() - t0 < args.measure_s:
        st = tr.train_step()
        tokens += st.tokens
        losses.append(st.loss)
        steps += 1
    _sync(dev)
    wall = time.perf_counter() - t0
    step_ms = wall / steps * 1e3
    breakdown = fast_breakdown(tr) if fast else baseline_breakdown(tr)
    gpu = sum(breakdown.get(k, 0.0) for k in ("target", "drafter", "optimizer"))
    if not fast:
        gpu += breakdown["pack_anchors"]
    # Host: what the steady step spends outside the stages' GPU time.
    breakdown["host"] = max(0.0, step_ms - gpu)
    breakdown["steady_step"] = step_ms
    peak = torch.cuda.max_memory_allocated(dev) / 1e9 if dev.type == "cuda" else 0.0
    return {
        "tokens_per_s": tokens / wall,
        "steps": steps,
        "tokens_per_step": tokens / steps,
        "breakdown_ms": {k: round(v, 3) for k, v in breakdown.items()},
        "peak_memory_gb": peak,
        "loss_first_last": [losses[0], losses[-1]],
        "graph_shapes": len(tr.fast.runner.static) if tr.fast is not None else 0,
    }


def documents(args: argparse.Namespace, cfg: Config) -> tuple[TrainData, str]:
    if args.data:
        from dflash_trainer.data.shards import PreparedDataset

        train = PreparedDataset(Path(args.data), "train")
        return TrainData(train=train, eval=None, path=Path(args.data)), f"prepared {args.data}"
    from dflash_trainer.config import replace
    from dflash_trainer.target.configs import load_target_config

    vocab = load_target_config(replace(cfg, target={"random_init": True}).target).vocab_size
    n = args.docs
    src = SyntheticDocs(n, vocab, cfg.drafter.mask_token_id or 0, cfg.data.doc_limit)
    return TrainData(train=src, eval=None, path=None), f"synthetic: {n} documents, random ids"


def hardware(dev: torch.device) -> dict[str, Any]:
    import transformers

    out: dict[str, Any] = {
        "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else platform.processor(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "transformers": transformers.__version__,
        "cpu_threads": torch.get_num_threads(),
    }
    return out


def run_path(
    args, base, data, fast: bool, tmp: Path, extra: tuple[str, ...] = ()
) -> dict[str, Any]:
    name = ("fast" if fast else "baseline") + "".join(f"_{i}" for i in range(len(extra)))
    cfg = make_config(args, base, fast, tmp / name, extra)
    tr = Trainer(cfg, log_to_console=args.verbose, data=data)
    res = measure(tr, args, fast)
    res["step_path"] = "fast" if tr.fast is not None else "standard"
    res["token_budget"] = cfg.data.token_budget
    res["max_anchors"] = cfg.training.max_anchors
    res["loss_chunk_rows"] = cfg.training.loss_chunk_rows
    res["compile"] = tr.compile
    if tr.fast is not None:
        res["fast_shapes"] = tr.fast.describe()
        tr.fast.close()
    del tr
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tiny", action="store_true", help="a tiny random llama (CPU smoke test)")
    ap.add_argument("--data", help="a prepared dataset directory (real token ids)")
    ap.add_argument("--docs", type=int, default=20000, help="synthetic documents")
    ap.add_argument("--base-budget", type=int, default=None, help="default: the recipe's")
    ap.add_argument("--base-anchors", type=int, default=None, help="default: the recipe's")
    ap.add_argument("--fast-budget", type=int, default=None, help="default 65536 (tiny 2048)")
    ap.add_argument("--fast-chunk-rows", type=int, default=8192)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--max-warmup", type=int, default=25)
    ap.add_argument("--min-steps", type=int, default=5)
    ap.add_argument("--measure-s", type=float, default=15.0)
    ap.add_argument(
        "--flex-target",
        action="store_true",
        help="also the fast step with training.target_attention=flex (a third leg)",
    )
    ap.add_argument("--verbose", action="store_true")
    args = ap.parse_args()
    dev = torch.device(args.device)
    tmp = Path(tempfile.mkdtemp(prefix="dflash-train-speed-"))
    base = tiny_config(tmp, args.device) if args.tiny else None
    ref = config_from_dict(base) if base is not None else load_config(recipe=RECIPE)
    args.base_budget = args.base_budget or ref.data.token_budget
    args.base_anchors = args.base_anchors or ref.training.max_anchors
    args.fast_budget = args.fast_budget or (2048 if args.tiny else 65536)
    if args.tiny:
        args.docs = min(args.docs, 400)
        args.measure_s = min(args.measure_s, 2.0)
    data, source = documents(args, ref)
    t0 = time.perf_counter()
    baseline = run_path(args, base, data, False, tmp)
    fast = run_path(args, base, data, True, tmp)
    out = {
        "fast_tokens_per_s": fast["tokens_per_s"],
        "baseline_tokens_per_s": baseline["tokens_per_s"],
        "breakdown_baseline_ms": baseline["breakdown_ms"],
        "breakdown_fast_ms": fast["breakdown_ms"],
        "peak_memory_gb_baseline": baseline["peak_memory_gb"],
        "peak_memory_gb_fast": fast["peak_memory_gb"],
        "speedup": fast["tokens_per_s"] / baseline["tokens_per_s"],
        "settings": {
            "recipe": "tiny" if args.tiny else RECIPE,
            "data": source,
            "baseline": {k: v for k, v in baseline.items() if k not in ("breakdown_ms",)},
            "fast": {k: v for k, v in fast.items() if k not in ("breakdown_ms",)},
            "measure_s": args.measure_s,
            "peak_memory": "max allocated over the measured steps (after warm-up)",
            "wall_s": time.perf_counter() - t0,
        },
        "hardware": hardware(dev),
    }
    flex = None
    if args.flex_target:
        # A leg that fails (the flex target is new on the GPU) keeps the two measured above.
        try:
            flex = run_path(args, base, data, True, tmp, ("training.target_attention=flex",))
        except Exception as e:
            out["fast_flex_target_error"] = f"{type(e).__name__}: {e}"
            print(f"the flex-target leg failed: {out['fast_flex_target_error']}", file=sys.stderr)
    if flex is not None:
        out["fast_flex_target_tokens_per_s"] = flex["tokens_per_s"]
        out["breakdown_fast_flex_target_ms"] = flex["breakdown_ms"]
        out["peak_memory_gb_fast_flex_target"] = flex["peak_memory_gb"]
        out["flex_target_over_fast"] = flex["tokens_per_s"] / fast["tokens_per_s"]
        out["settings"]["fast_flex_target"] = {
            k: v for k, v in flex.items() if k not in ("breakdown_ms",)
        }
        out["settings"]["wall_s"] = time.perf_counter() - t0
    tmp_out = Path(args.out).with_suffix(".tmp")
    tmp_out.write_text(json.dumps(out, indent=2, default=str))
    tmp_out.replace(args.out)
    print(json.dumps(out, indent=2, default=str))
    print(
        f"\nbaseline {out['baseline_tokens_per_s']:,.0f} tok/s, fast {out['fast_tokens_per_s']:,.0f}"
        f" tok/s ({out['speedup']:.2f}x); written to {args.out}"
    )


if __name__ == "__main__":
    main()
