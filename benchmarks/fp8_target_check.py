"""The FP8 target (`target.precision=fp8`) against the bf16 one on a real model: what the
drafter learns from, and what it serves.

    # both checks, resumable stage by stage (what benchmarks/gpu/fp8_target_check.sh runs):
    python benchmarks/fp8_target_check.py all --out OUT [--data PREPARED_OR_RAW]
    python benchmarks/fp8_target_check.py hidden --out OUT [--docs 64]
    python benchmarks/fp8_target_check.py tau --out OUT [--steps 150 --sets gsm8k,mt-bench]

hidden: the target's tapped hidden states (the drafter's context features) and its label
  tokens (argmax) on real prepared text, FP8 against bf16, per tapped layer: mean and
  minimum per-token cosine and relative error (||fp8 - bf16|| / ||bf16||); the fraction of
  supervised positions whose label changes, also excluding near-ties (bf16 top-2 logit gap
  under 0.25). The same figures for bf16 against fp32 (the same weights) are the noise floor
  that bf16 itself adds.
tau: two drafters trained with the `smollm2-135m` recipe (same data, steps and seed), one
  against the bf16 target and one against the FP8 target, each evaluated with `dflash eval`
  against the bf16 and the FP8 target (tau only: --no-baseline).

Stages (each skipped when its output exists, so a killed run continues where it stopped):
  target   the target saved once as bf16 safetensors in OUT/target (a GGUF asset is
           dequantised once instead of at every load)
  data     OUT/data/prepared from --data (raw conversations or an asset), unless --data is
           already a prepared directory
  hidden   -> results "hidden_states"
  train    OUT/train_bf16, OUT/train_fp8 (`dflash train`, resumed from checkpoints)
  eval     OUT/eval_<trained>_trained_<served>_served/eval.json (`dflash eval`)
Results merge (atomically, under a lock) into --results, default
OUT/fp8_target_<gpu>.json, beside the keys benchmarks/online_step.py writes there:
  {"hidden_states": {...}, "tau": {"bf16_trained": {"bf16_served": {set: tau}, "fp8_served":
  {...}}, "fp8_trained": {...}}, "tau_change": {set: fp8-trained / bf16-trained - 1}}

On a CPU (--device cpu, a rehearsal with tiny overrides) the hidden check runs the FP8
linears through the CPU `_scaled_mm` where this PyTorch has one; training and serving with
an FP8 target are refused there, and the refusal is recorded in the results.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

RECIPE = "smollm2-135m"
TIE_GAP = 0.25
"""A bf16 top-2 logit gap below this is a numerical tie (the lossless check's threshold)."""


# ------------------------------------------------------------------------ results file


def gpu_slug() -> str:
    """h100, h200, b200, rtx-pro-6000; `cpu` without a GPU; else `gpu`."""
    import torch

    if not torch.cuda.is_available():
        return "cpu"
    name = torch.cuda.get_device_name().lower()
    for key, slug in (
        ("h100", "h100"),
        ("h200", "h200"),
        ("b200", "b200"),
        ("6000", "rtx-pro-6000"),
    ):
        if key in name:
            return slug
    return "gpu"


def results_path(path: str | Path) -> Path:
    """A directory means `<dir>/fp8_target_<gpu>.json`."""
    p = Path(path)
    return p / f"fp8_target_{gpu_slug()}.json" if p.is_dir() else p


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """An exclusive lock for `path`, its file in the temp dir (not beside the results)."""
    import hashlib
    import tempfile

    path.parent.mkdir(parents=True, exist_ok=True)
    key = hashlib.sha256(str(path.resolve()).encode()).hexdigest()[:16]
    with open(Path(tempfile.gettempdir()) / f"fp8_target_{key}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def merge_json(path: Path, updates: dict[str, Any]) -> dict[str, Any]:
    """Top-level keys of `updates` replace the file's; the rest stays. Written next to the file
    and renamed, under a lock: two writers (online_step.py and this script) lose nothing."""
    path = results_path(path)
    with _locked(path):
        data: dict[str, Any] = {}
        if path.is_file():
            try:
                data = json.loads(path.read_text())
            except json.JSONDecodeError:
                # A damaged file is kept aside, not silently overwritten.
                path.rename(path.with_name(path.name + f".damaged-{int(time.time())}"))
        data.update(updates)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps(data, indent=1, allow_nan=False) + "\n")
        os.replace(tmp, path)
    return data


# ----------------------------------------------------------------------- target, data


def stage_target(args: argparse.Namespace) -> str:
    """The target as a local bf16 directory (saved once), or --target when it is one."""
    if (Path(args.target) / "config.json").is_file():
        return args.target
    out = Path(args.out) / "target"
    if (out / "config.json").is_file():
        return str(out)
    from dflash_trainer.config import TargetConfig
    from dflash_trainer.data.loading import load_tokenizer, tokenizer_spec
    from dflash_trainer.target.model import load_target_model

    tcfg = TargetConfig(name_or_path=args.target, dtype="bfloat16")
    model = load_target_model(tcfg, "cpu")
    # The GGUF loader's markers: the weights are plain bf16 tensors now (reloads need no gguf).
    model.hf_quantizer = None
    with contextlib.suppress(AttributeError):
        del model.config.quantization_config
    tmp = out.with_name("target.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    load_tokenizer(tokenizer_spec(tcfg)).save_pretrained(tmp)
    os.replace(tmp, out)
    print(f"target saved as bf16 safetensors in {out}", flush=True)
    return str(out)


def stage_data(args: argparse.Namespace, target: str) -> str:
    """A prepared directory: --data when it is one, else OUT/data/prepared made from it."""
    from dflash_trainer.train.dataset import is_prepared, load_train_data

    if is_prepared(args.data):
        return str(args.data)
    cfg = recipe_config(
        args, target, [f"data.train={args.data}", f"data.max_records={args.records}"]
    )
    data = load_train_data(cfg, Path(args.out), True)  # prepares OUT/data/prepared once
    return str(data.train.path)


def recipe_config(args: argparse.Namespace, target: str, extra: list[str]) -> Any:
    from dflash_trainer.config import load_config

    over = [f"target.name_or_path={target}", f"run.output_dir={Path(args.out) / 'run'}"]
    return load_config(recipe=args.recipe, overrides=[*over, *args.override, *extra])


# ------------------------------------------------------------------------------ hidden


def stage_hidden(args: argparse.Namespace, target: str, data: str) -> dict[str, Any]:
    import copy

    import torch

    from dflash_trainer.core.geometry import resolve_drafter_spec
    from dflash_trainer.data.shards import PreparedDataset
    from dflash_trainer.target.fp8 import fp8_mode, quantize_linears
    from dflash_trainer.target.model import FrozenTarget, decoder_layers, load_target_model

    cfg = recipe_config(args, target, [f"data.train={data}"])
    bf16 = load_target_model(cfg.target, args.device)
    layer_ids = resolve_drafter_spec(cfg.drafter, bf16.config).target_layer_ids
    fp8 = copy.deepcopy(bf16)
    # The loader's own conversion; on a CPU the row-wise kernel is the CPU _scaled_mm.
    mode = fp8_mode(args.device) if args.device != "cpu" else "rowwise"
    report = quantize_linears(fp8, decoder_layers(fp8), mode=mode)
    fp32 = copy.deepcopy(bf16).float()
    targets = {
        k: FrozenTarget(m, layer_ids) for k, m in (("bf16", bf16), ("fp8", fp8), ("fp32", fp32))
    }
    ds = PreparedDataset(data, "train")
    docs = [ds[i] for i in range(min(args.docs, len(ds)))]
    acc = {"fp8_vs_bf16": _Acc(len(layer_ids)), "bf16_vs_fp32": _Acc(len(layer_ids))}
    for start in range(0, len(docs), args.batch_docs):
        batch = docs[start : start + args.batch_docs]
        ids = [torch.as_tensor(d.input_ids, dtype=torch.long) for d in batch]
        # Supervised positions whose label (the argmax at the previous position) is trained.
        sup = torch.cat([torch.as_tensor(d.loss_mask[1:], dtype=torch.bool) for d in batch])
        out = {k: t.forward_documents(ids) for k, t in targets.items()}
        logits = {k: _label_logits(targets[k], out[k], batch, sup) for k in out}
        acc["fp8_vs_bf16"].add(out["fp8"], out["bf16"], logits["fp8"], logits["bf16"])
        acc["bf16_vs_fp32"].add(out["bf16"], out["fp32"], logits["bf16"], logits["fp32"])
    return {
        "model": args.target,
        "model_dir": target,
        "device": args.device,
        "documents": len(docs),
        "tokens": sum(len(d.input_ids) for d in docs),
        "tapped_layers": list(layer_ids),
        "fp8_conversion": report.summary(),
        "fp8_mode": mode,
        **{k: a.result(layer_ids) for k, a in acc.items()},
    }


def _label_logits(target: Any, out: Any, batch: list[Any], sup: Any) -> Any:
    """Logits (fp32) at the positions whose next token is supervised: where labels come from."""
    import torch

    keep = []
    start = 0
    for d in batch:
        n = len(d.input_ids)
        keep.append(torch.arange(start, start + n - 1))
        start += n
    rows = out.final_hidden_TH[torch.cat(keep)][sup.to(out.final_hidden_TH.device)]
    w = target.lm_head_weight
    return (rows.to(w.dtype) @ w.t()).float()


class _Acc:
    """Sums over batches of the per-layer and label statistics of one comparison."""

    def __init__(self, n_layers: int) -> None:
        self.cos_sum = [0.0] * n_layers
        self.cos_min = [1.0] * n_layers
        self.err2 = [0.0] * n_layers
        self.ref2 = [0.0] * n_layers
        self.tokens = 0
        self.labels = self.changed = self.clear = self.changed_clear = 0

    def add(self, got: Any, ref: Any, got_logits: Any, ref_logits: Any) -> None:
        import torch

        n = len(self.cos_sum)
        for i, (a, b) in enumerate(zip(got.features_TF.chunk(n, -1), ref.features_TF.chunk(n, -1))):
            a, b = a.float(), b.float().to(a.device)
            cos = torch.nn.functional.cosine_similarity(a, b, dim=-1)
            self.cos_sum[i] += float(cos.sum())
            self.cos_min[i] = min(self.cos_min[i], float(cos.min()))
            self.err2[i] += float((a - b).pow(2).sum())
            self.ref2[i] += float(b.pow(2).sum())
        self.tokens += got.features_TF.shape[0]
        ref_logits = ref_logits.to(got_logits.device)
        top2 = ref_logits.topk(2, dim=-1).values
        clear = (top2[:, 0] - top2[:, 1]) >= TIE_GAP
        changed = got_logits.argmax(-1) != ref_logits.argmax(-1)
        self.labels += int(changed.numel())
        self.changed += int(changed.sum())
        self.clear += int(clear.sum())
        self.changed_clear += int((changed & clear).sum())

    def result(self, layer_ids: list[int]) -> dict[str, Any]:
        layers = {
            str(lid): {
                "cosine_mean": self.cos_sum[i] / max(self.tokens, 1),
                "cosine_min": self.cos_min[i],
                "relative_error": (self.err2[i] / max(self.ref2[i], 1e-30)) ** 0.5,
            }
            for i, lid in enumerate(layer_ids)
        }
        return {
            "layers": layers,
            "labels": self.labels,
            "labels_changed_fraction": self.changed / max(self.labels, 1),
            "labels_changed_excluding_ties_fraction": self.changed_clear / max(self.clear, 1),
            "tie_gap": TIE_GAP,
        }


# --------------------------------------------------------------------------------- tau


def _dflash(argv: list[str], log: Path) -> int:
    """`python -m dflash_trainer.cli ARGV`, output appended to `log` (argv list, no shell)."""
    cmd = [sys.executable, "-m", "dflash_trainer.cli", *argv]
    with open(log, "a") as f:
        f.write(f"$ {' '.join(cmd)}\n")
        f.flush()
        rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, check=False).returncode
    print(f"  {' '.join(argv[:2])} ... -> exit {rc} (log {log})", flush=True)
    return rc


def _log_tail(log: Path, lines: int = 3) -> str:
    text = log.read_text(errors="replace").strip().splitlines() if log.is_file() else []
    return " | ".join(text[-lines:])


def stage_train(args: argparse.Namespace, target: str, data: str, precision: str) -> str | None:
    """OUT/train_<precision>: trained (or resumed to the end); None and the error when it fails."""
    run = Path(args.out) / f"train_{precision}"
    if (run / "drafter").is_dir():
        return None
    log = Path(args.out) / f"train_{precision}.log"
    if (run / "checkpoints" / "LATEST").is_file():
        rc = _dflash(["train", "--resume", str(run)], log)
    else:
        over = [
            f"target.name_or_path={target}",
            f"target.precision={precision}",
            f"data.train={data}",
            f"training.max_steps={args.steps}",
            f"training.seed={args.seed}",
            "training.eval_every=0",
            f"training.device={args.device}",
            f"run.output_dir={run}",
            *args.override,
        ]
        rc = _dflash(["train", "--recipe", args.recipe, "--overwrite", *over], log)
    return None if rc == 0 and (run / "drafter").is_dir() else f"exit {rc}: {_log_tail(log)}"


def stage_eval(args: argparse.Namespace, trained: str, served: str) -> dict[str, Any]:
    """tau per prompt set of the drafter trained against `trained`, served with `served`."""
    out = Path(args.out) / f"eval_{trained}_trained_{served}_served"
    report = out / "eval.json"
    if not report.is_file():
        log = Path(args.out) / f"{out.name}.log"
        argv = ["eval", "--drafter", str(Path(args.out) / f"train_{trained}")]
        argv += ["--target-precision", served, "--device", args.device, "--prompts", args.sets]
        argv += ["--max-samples", str(args.samples), "--max-new-tokens", str(args.max_new_tokens)]
        argv += ["--seed", str(args.seed), "--no-baseline", "--allow-mismatch", "--no-progress"]
        rc = _dflash([*argv, "--out-dir", str(out)], log)
        if rc != 0 or not report.is_file():
            return {"error": f"exit {rc}: {_log_tail(log)}"}
    sets = json.loads(report.read_text())["sets"]
    return {label: s.get("tau") for label, s in sets.items()}


def stage_tau(args: argparse.Namespace, target: str, data: str) -> dict[str, Any]:
    tau: dict[str, Any] = {}
    for trained in ("bf16", "fp8"):
        err = stage_train(args, target, data, trained)
        if err is not None:
            tau[f"{trained}_trained"] = {"error": f"training: {err}"}
            continue
        tau[f"{trained}_trained"] = {
            f"{served}_served": stage_eval(args, trained, served) for served in ("bf16", "fp8")
        }
    change = {}
    base = tau.get("bf16_trained", {}).get("bf16_served", {})
    new = tau.get("fp8_trained", {}).get("bf16_served", {})
    for label, t in base.items():
        if isinstance(t, float) and isinstance(new.get(label), float) and t > 0:
            change[label] = new[label] / t - 1
    return {
        "tau": tau,
        "tau_change": change,
        "tau_settings": {
            "recipe": args.recipe,
            "steps": args.steps,
            "seed": args.seed,
            "overrides": args.override,
            "sets": args.sets,
            "samples": args.samples,
            "max_new_tokens": args.max_new_tokens,
            "data": data,
        },
    }


# ---------------------------------------------------------------------------------- CLI


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("mode", choices=["all", "hidden", "tau"])
    ap.add_argument("--out", required=True, help="working directory (stages resume from it)")
    ap.add_argument("--results", help="results JSON (default OUT/fp8_target_<gpu>.json)")
    ap.add_argument("--target", default="asset:smollm2-135m-instruct")
    ap.add_argument("--data", default="asset:sharegpt", help="prepared dir, or raw conversations")
    ap.add_argument("--records", type=int, default=3000, help="raw records to prepare")
    ap.add_argument("--recipe", default=RECIPE)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--docs", type=int, default=64, help="hidden: documents compared")
    ap.add_argument("--batch-docs", type=int, default=8, help="hidden: documents per forward")
    ap.add_argument("--steps", type=int, default=150, help="tau: training steps per drafter")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--sets", default="gsm8k,mt-bench")
    ap.add_argument("--samples", type=int, default=10, help="tau: prompts per set")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--override", nargs="*", default=[], help="more training overrides a.b=v")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    results = Path(args.results) if args.results else Path(args.out)
    t0 = time.perf_counter()
    target = stage_target(args)
    data = stage_data(args, target)
    print(f"target {target}, data {data} ({time.perf_counter() - t0:.0f} s)", flush=True)
    if args.mode in ("all", "hidden"):
        hidden = stage_hidden(args, target, data)
        merge_json(results, {"hidden_states": hidden})
        print(json.dumps(hidden, indent=1), flush=True)
    if args.mode in ("all", "tau"):
        merged = merge_json(results, stage_tau(args, target, data))
        print(json.dumps({k: merged[k] for k in ("tau", "tau_change")}, indent=1), flush=True)
    print(f"wrote {results_path(results)} ({time.perf_counter() - t0:.0f} s)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
