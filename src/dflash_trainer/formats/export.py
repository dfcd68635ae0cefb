"""`dflash export` / `dflash import`: move drafters between this project and the engines.

Three layouts, one `DrafterSpec` in the middle (docs/formats.md lists every field):

    project files  spec.json + drafter.safetensors + meta.json   (drafter_io.py)
    zlab           config.json + model.safetensors   z-lab reference, vLLM, SGLang
    speculators    config.json + model.safetensors   speculators / vLLM

`import_drafter` reads any of them into (spec, state dict, meta), so `train`
(fine-tuning) and `eval` accept a published drafter wherever they accept a run.
`export_drafter` writes one of the two engine layouts and then runs the same
checks as `dflash export --check` on what it wrote: an export that an engine would
load wrongly is an error here, not a silent zero acceptance there.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from dflash_trainer.assets import serving_name
from dflash_trainer.atomic_dir import atomic_directory, check_replaceable, write_file_atomic
from dflash_trainer.core.geometry import DrafterSpec
from dflash_trainer.errors import DFlashError
from dflash_trainer.formats.card import hub_id, model_card, read_eval_report, serve_commands
from dflash_trainer.formats.check import (
    DTYPES,
    CheckReport,
    check_export,
    check_import_numbers,
    read_config,
)
from dflash_trainer.formats.dflash2_layout import bare_codebooks, kind_mismatch
from dflash_trainer.formats.drafter_io import META_FILE, SPEC_FILE, load_drafter, write_drafter_dir
from dflash_trainer.formats.safetensors_check import check_finite
from dflash_trainer.formats.speculators import (
    VERIFIER_TENSORS,
    spec_from_speculators_config,
    speculators_config,
    verifier_name,
)
from dflash_trainer.formats.weights import WEIGHTS_NAME, read_weights, write_weights
from dflash_trainer.formats.zlab import (
    KINDS,
    expected_tensor_shapes,
    spec_from_zlab_config,
    zlab_config,
)
from dflash_trainer.input_files import read_small_text
from dflash_trainer.lineage.record import LINEAGE_FILES
from dflash_trainer.outputs import check_not_input, locks_output, writing

FORMATS = ("zlab", "speculators")
Imported = tuple[DrafterSpec, dict[str, torch.Tensor], dict[str, Any]]


def detect_format(path: str | Path) -> str:
    """'dflash' (this project's files or a run dir), 'zlab' or 'speculators'."""
    p = Path(path)
    if not p.exists():
        raise DFlashError(f"{p}: no such directory")
    # lexists: a damaged spec.json or LATEST is named by its reader, not taken for an export.
    if any(
        os.path.lexists(p / f) for f in (SPEC_FILE, f"drafter/{SPEC_FILE}", "checkpoints/LATEST")
    ):
        return "dflash"
    cfg = read_config(p)
    if "speculators_model_type" in cfg:
        return "speculators"
    archs = cfg.get("architectures")
    if "dflash_config" in cfg or (isinstance(archs, list) and set(map(str, archs)) & set(KINDS)):
        return "zlab"
    raise DFlashError(
        f"{p}/config.json: neither a z-lab DFlash config (dflash_config) nor a speculators "
        "config (speculators_model_type); not a DFlash drafter"
    )


# ----------------------------------------------------------------------------- target


def target_info(name: str | None, gguf_file: str | None = None) -> tuple[Any, set[int]]:
    """(text HF config, EOS/PAD ids) of a target, read without its weights."""
    from dflash_trainer.config import TargetConfig
    from dflash_trainer.target.configs import load_target_config

    if not name:
        raise DFlashError("no target given")
    cfg = load_target_config(TargetConfig(name_or_path=name, gguf_file=gguf_file))
    special: set[int] = set()
    sources = [cfg]
    gen = Path(name) / "generation_config.json"
    if gen.is_file():  # stop tokens of chat models often live only here
        try:
            sources.append(json.loads(read_small_text(gen, "generation config")))
        except (ValueError, RecursionError) as e:
            raise DFlashError(f"{gen}: not valid JSON ({e}); fix or remove the file") from e
    for src in sources:
        for key in ("eos_token_id", "pad_token_id"):
            value = src.get(key) if isinstance(src, dict) else getattr(src, key, None)
            ids = value if isinstance(value, list) else [value]
            special |= {int(i) for i in ids if i is not None}
    return cfg, special


def _readable_offline(name: str) -> bool:
    """A local dir/file, a bundled asset or a bundled hub config: no network needed."""
    from dflash_trainer.target.configs import KNOWN_CONFIGS

    return name.startswith("asset:") or name in KNOWN_CONFIGS or Path(name).exists()


def _optional_target(name: str | None, gguf: str | None, explicit: bool) -> tuple[Any, set[int]]:
    """The target's config when it can be read. Only a target named with --target may
    go to the hub (and must be readable); one recorded in the drafter's files is read
    only when that needs no network, so exporting never stalls on a download."""
    if not name:
        return None, set()
    if not explicit and not _readable_offline(name):
        print(
            f"note: target {name!r} is not local; pass --target {name} to check against "
            "it (reads its config from the hub)",
            file=sys.stderr,
        )
        return None, set()
    try:
        return target_info(name, gguf)
    except (DFlashError, OSError, ValueError) as e:
        if explicit:
            raise DFlashError(f"--target {name}: cannot read its config ({e})") from e
        print(
            f"note: target {name!r} not readable here ({e}); target checks skipped", file=sys.stderr
        )
        return None, set()


# ----------------------------------------------------------------------------- import


def _check_state(spec: DrafterSpec, state: dict[str, torch.Tensor], where: str) -> None:
    expected = expected_tensor_shapes(spec)
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    wrong = [
        f"{k} {list(state[k].shape)} (config implies {list(s)})"
        for k, s in expected.items()
        if k in state and tuple(state[k].shape) != s
    ]
    mismatch = kind_mismatch(spec.kind, set(state))
    if mismatch:
        raise DFlashError(f"{where}: {mismatch[0]}; {mismatch[1]}")
    if missing or unexpected or wrong:
        raise DFlashError(
            f"{where}: weights do not match the config: missing {missing[:4]}, unexpected "
            f"{unexpected[:4]}, wrong shapes {wrong[:3]}. The config's geometry (heads, "
            "head_dim, target_layer_ids, target_hidden_size) must describe these tensors"
        )


def import_drafter(path: str | Path, target: str | None = None) -> Imported:
    """(spec, state dict in its stored dtype, meta) from any supported layout.

    `target` names the target (hub id, local dir or asset) when a speculators config
    does not record the target's layer count; otherwise it is read from the config's
    verifier. Defaults filled for missing fields are emitted as UserWarnings and kept
    in meta["import_warnings"].
    """
    p = Path(path)
    fmt = detect_format(p)
    if fmt == "dflash":
        return load_drafter(p)
    cfg = read_config(p)
    where = str(p / "config.json")
    _validate_import(p, cfg, target)
    meta: dict[str, Any] = {"source": {"format": fmt, "path": str(p), "config": cfg}}
    if fmt == "zlab":
        spec, notes = spec_from_zlab_config(cfg, where)
        # The layout has no target field; an export's model card names it (`base_model`).
        base = _card_base_model(p)
        if base:
            meta["target"] = {"name_or_path": base}
    else:
        n_target = None
        name = target or verifier_name(cfg)
        if "num_target_layers" not in cfg and name:
            try:
                n_target = int(target_info(name)[0].num_hidden_layers)
            except (DFlashError, OSError, ValueError) as e:
                raise DFlashError(
                    f"{where}: records no num_target_layers and the target {name!r} is not "
                    f"readable ({e}); pass --target NAME_OR_PATH of a readable target config"
                ) from e
        spec, notes = spec_from_speculators_config(cfg, where, n_target)
        meta["target"] = {"name_or_path": verifier_name(cfg)}
    state = read_weights(p)
    check_finite(state, str(p))
    dropped = sorted(k for k in state if k in VERIFIER_TENSORS)
    state = {k: v for k, v in state.items() if k not in VERIFIER_TENSORS}
    if dropped:  # the target's own tensors: this project uses the live target's copies
        notes.append(f"{p}: ignored the target's tensors stored with the drafter: {dropped}")
    state, renamed = bare_codebooks(state, str(p))
    notes += renamed
    # Before the shape check: a filled-in default (head_dim 128) explains a mismatch.
    for note in notes:
        warnings.warn(note, UserWarning, stacklevel=2)
    _check_state(spec, state, str(p))
    meta["import_warnings"] = notes
    return spec, state, meta


def _validate_import(p: Path, cfg: dict[str, Any], target: str | None) -> None:
    """Refuse a config no drafter can be built from (CheckReport findings as one error);
    with --target, also one whose vocab/hidden/layers differ from that target's."""
    t_cfg = target_info(target)[0] if target else None
    report = check_import_numbers(p, cfg, t_cfg)
    if not report.ok:
        raise DFlashError(
            f"{p / 'config.json'}: cannot import this drafter:\n"
            + "\n".join(report.render().splitlines()[1:-1])
        )


# ----------------------------------------------------------------------------- export


@dataclass
class ExportResult:
    path: Path
    fmt: str
    report: CheckReport
    commands: dict[str, str]


def _check_out(out: Path, force: bool) -> None:
    """OUT may be new or empty; with --force it may hold a previous export (only our files:
    extra weights next to ours would be loaded too, or instead), which is then replaced."""
    if out.is_dir() and any(out.iterdir()) and not force:
        raise DFlashError(f"{out}: exists and is not empty; choose a new directory or --force")
    ours = {"config.json", WEIGHTS_NAME, "README.md", *LINEAGE_FILES}
    check_replaceable(out, ours.__contains__, f"an export (--force replaces only {sorted(ours)})")


def _cast(state: dict[str, torch.Tensor], dtype: str, where: str) -> dict[str, torch.Tensor]:
    out = {}
    for name, t in state.items():
        if not bool(torch.isfinite(t.float()).all()):
            raise DFlashError(f"{where}: {name} holds NaN/inf; export an earlier checkpoint")
        cast = t.to(DTYPES[dtype])
        if not bool(torch.isfinite(cast.float()).all()):
            raise DFlashError(f"{where}: {name} overflows {dtype}; export as bfloat16 or float32")
        out[name] = cast
    return out


@locks_output("out", "dflash export", "the export")
def export_drafter(
    source: str | Path,
    out: str | Path,
    fmt: str,
    dtype: str = "bfloat16",
    target: str | None = None,
    force: bool = False,
    evals: list[str] | None = None,
) -> ExportResult:
    """Write `source` (run dir, checkpoint, our files, or another export) as `fmt`.

    `target` overrides the target recorded in the drafter's meta (the name written
    into the card and, for speculators, the verifier); the export is checked
    against the target's config whenever that config can be read.
    """
    if fmt not in FORMATS:
        raise DFlashError(f"--to {fmt}: choose one of {list(FORMATS)}")
    if dtype not in DTYPES:
        raise DFlashError(f"--dtype {dtype}: choose one of {sorted(DTYPES)}")
    check_not_input(out, "export OUT", [source], replaced_whole=True)
    reports = [read_eval_report(e) for e in evals or []]  # refused before anything is written
    spec, state, meta = import_drafter(source, target=target)
    _check_state(spec, state, str(source))
    out_p = Path(out)
    name = target or _meta_target(meta)
    gguf = None if target else (meta.get("target") or {}).get("gguf_file")
    t_cfg, special = _optional_target(name, gguf, explicit=target is not None)
    tensors = _cast(state, dtype, str(source))
    carried = _source_lineage(source, state)
    serve = serving_name(name)  # what the card, the verifier and serve commands name
    if fmt == "zlab":
        config = zlab_config(spec, dtype)
    else:
        archs = list(getattr(t_cfg, "architectures", None) or [])
        config = speculators_config(spec, dtype, serve, archs)
    _check_out(out_p, force)
    with atomic_directory(out_p, replace=True) as tmp:  # never a half-written export
        write_weights(tmp / WEIGHTS_NAME, tensors)
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
        if carried is not None:
            _export_lineage(tmp, carried, fmt, dtype, evals or [])
        lineage, prompts = carried if carried is not None else (None, None)
        card = model_card(spec, meta, fmt, str(out_p), serve, reports, lineage, prompts)
        write_file_atomic(tmp / "README.md", card)
    report = check_export(out_p, t_cfg, special)
    if fmt == "speculators" and serve and not hub_id(serve) and not Path(serve).exists():
        report.warn(
            "speculators_config.verifier.name_or_path",
            f"{serve!r} is neither a hub id nor a local path: `vllm serve DIR` cannot load it",
            "re-export with --target set to the target's hub id or directory",
        )
    return ExportResult(out_p, fmt, report, serve_commands(fmt, str(out_p), serve, spec))


def _source_lineage(source: str | Path, state: dict[str, torch.Tensor]) -> Any:
    """(lineage, prompt ids) of the drafter being exported, checked against its weights."""
    from dflash_trainer.lineage.record import (
        check_describes,
        lineage_dir,
        read_lineage,
        read_prompts,
        weights_sha256,
    )

    lineage = read_lineage(source)
    if lineage is None:
        return None
    check_describes(lineage, weights_sha256(state), str(lineage_dir(source)))
    return lineage, read_prompts(source)


def _export_lineage(tmp: Path, carried: Any, fmt: str, dtype: str, evals: list[str]) -> None:
    """The lineage into the export, with the export's weights hash (read back as `dflash
    train --init-from` reads it) and the reports given with --eval attached."""
    from dflash_trainer.lineage.record import now, weights_sha256, write_lineage
    from dflash_trainer.lineage.served import eval_entry

    lineage, prompts = carried
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the import's notes were shown for the source
        h = weights_sha256(import_drafter(tmp)[1])
    if lineage["continuations"]:
        last = lineage["continuations"][-1]
        exports = [e for e in last.get("exports") or [] if e.get("weights_sha256") != h]
        last["exports"] = [*exports, {"format": fmt, "dtype": dtype, "weights_sha256": h,
                                      "date": now()}]  # fmt: skip
        last.setdefault("evals", []).extend(eval_entry(e) for e in evals)
    write_lineage(tmp, lineage, prompts)


def _meta_target(meta: dict[str, Any]) -> str | None:
    t = meta.get("target")
    return str(t["name_or_path"]) if isinstance(t, dict) and t.get("name_or_path") else None


# ----------------------------------------------------------------------------- CLI


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.usage = (
        "dflash export SOURCE --to {zlab,speculators} OUT [--dtype D] [--target T] [--eval R]\n"
        "       dflash export --check OUT [--target T]"
    )
    p.add_argument("source", nargs="?", help="run dir, checkpoint dir, or drafter/export dir")
    p.add_argument("out", nargs="?", help="directory to write (new or empty)")
    # argparse cannot match a positional after an option (`SOURCE --to zlab OUT`):
    # the optional OUT positional is settled before --to is seen. So --to also takes
    # OUT, and `SOURCE OUT --to zlab` works as well.
    p.add_argument(
        "--to",
        nargs="+",
        metavar=("{zlab,speculators}", "OUT"),
        help="layout to write, optionally followed by OUT",
    )
    p.add_argument(
        "--dtype",
        default="bfloat16",
        choices=sorted(DTYPES),
        help="weights dtype (default bfloat16, what engines serve)",
    )
    p.add_argument("--target", help="target hub id / dir / asset (default: the one in meta.json)")
    p.add_argument("--check", metavar="DIR", help="validate an exported directory instead")
    p.add_argument("--force", action="store_true", help="overwrite our files in OUT")
    p.add_argument(
        "--eval",
        action="append",
        metavar="REPORT",
        help="a `dflash eval` report (eval.json or its directory) of this drafter, written "
        "into the model card's measured acceptance; repeat for more",
    )


def run(args: argparse.Namespace) -> int:
    if args.check:
        if args.source or args.out or args.to or args.eval:
            raise DFlashError("--check takes only the directory to check (and --target)")
        return _run_check(Path(args.check), args.target)
    to = list(args.to or [])
    out = args.out
    if len(to) == 2 and out is None:
        out = to.pop()
    if not (args.source and out and len(to) == 1):
        raise DFlashError("give SOURCE, --to zlab|speculators and OUT (or --check DIR)")
    result = export_drafter(args.source, out, to[0], args.dtype, args.target, args.force, args.eval)
    print(result.report.render())
    if not result.report.ok:
        print(
            f"{result.path}: written but FAILED its checks; fix the source and export again",
            file=sys.stderr,
        )
        return 1
    print(f"wrote {result.path} ({result.fmt} layout); serve it with:")
    for engine, cmd in result.commands.items():
        print(f"\n# {engine}\n{cmd}")
    return 0


def _run_check(d: Path, target: str | None) -> int:
    cfg = read_config(d) if (d / "config.json").is_file() else {}
    explicit = target is not None
    name = target or verifier_name(cfg) or _card_base_model(d)
    t_cfg, special = _optional_target(name, None, explicit)
    report = check_export(d, t_cfg, special)
    print(report.render())
    return 0 if report.ok else 1


def _card_base_model(d: Path) -> str | None:
    """The `base_model:` of the export's model card front matter, if any."""
    card = d / "README.md"
    if not card.is_file():
        return None
    try:
        text = read_small_text(card, "model card")
    except DFlashError:
        return None  # the card only names the target; a damaged one names none
    if not text.startswith("---"):
        return None
    for line in text.split("---", 2)[1].splitlines():
        if line.startswith("base_model:"):
            return line.split(":", 1)[1].strip() or None
    return None


def add_import_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("path", help="z-lab or speculators drafter directory")
    p.add_argument("--out", help="write the project's drafter files here")
    p.add_argument("--target", help="target to read the layer count from (speculators only)")


def run_import(args: argparse.Namespace) -> int:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        spec, state, meta = import_drafter(args.path, target=args.target)
    for w in caught:
        print(f"warning: {w.message}", file=sys.stderr)
    n_params = sum(t.numel() for t in state.values())
    kind = "DFlash2" if spec.is_dflash2 else "DFlash"
    print(
        f"{args.path}: {meta.get('source', {}).get('format', 'dflash')} layout, {kind} drafter, "
        f"{spec.num_layers} layers, hidden {spec.hidden_size}, block {spec.block_size}, "
        f"{n_params / 1e6:.1f}M params, target_layer_ids {list(spec.target_layer_ids)}"
    )
    if args.out:
        check_not_input(args.out, "--out", [args.path], replaced_whole=True)
        with writing(args.out, "dflash import", f"the drafter directory {args.out}"):
            write_drafter_dir(args.out, spec, state, meta)
        print(f"wrote {Path(args.out) / SPEC_FILE} (+ weights, {META_FILE})")
    return 0
