"""The planner's view of the training set: `DataStats` from flags, a prepared dataset
(its shards, or its manifest's counts when the shards cannot be read), or an assumption.
"""

from __future__ import annotations

from pathlib import Path

from dflash_trainer.config import Config
from dflash_trainer.data.shards import read_manifest
from dflash_trainer.errors import DFlashError
from dflash_trainer.plan.workload import DataStats

DEFAULT_MEAN_TOKENS = 1024
DEFAULT_SUPERVISED_FRACTION = 0.5


def data_stats(
    cfg: Config,
    data: str | None = None,
    samples: int | None = None,
    mean_tokens: float | None = None,
    supervised_fraction: float | None = None,
) -> DataStats:
    """Dataset statistics: flags, else a prepared dir (--data or data.train), else an assumption."""
    if (samples is None) != (mean_tokens is None):
        raise DFlashError("give --samples and --mean-tokens together (or --data PATH)")
    if samples is not None and mean_tokens is not None:
        if samples < 1 or mean_tokens < 2:
            raise DFlashError("--samples must be >= 1 and --mean-tokens >= 2")
        frac = supervised_fraction or DEFAULT_SUPERVISED_FRACTION
        return DataStats.uniform(samples, mean_tokens, frac, "--samples/--mean-tokens")
    if data and not (Path(data) / "manifest.json").is_file():
        raise DFlashError(f"--data {data}: no manifest.json there (a `dflash data prepare` dir)")
    path = Path(data) if data else prepared_dir(cfg)
    if path is not None:
        return _prepared_stats(path, supervised_fraction)
    return DataStats.uniform(
        0,
        DEFAULT_MEAN_TOKENS,
        supervised_fraction or DEFAULT_SUPERVISED_FRACTION,
        f"assumed: documents of {DEFAULT_MEAN_TOKENS} tokens, dataset size unknown "
        "(give --data or --samples/--mean-tokens for per-epoch numbers)",
    )


def prepared_dir(cfg: Config) -> Path | None:
    """data.train when it is prepared, else what the trainer prepared in RUN/data/prepared."""
    for cand in (cfg.data.train, str(Path(cfg.run.output_dir) / "data" / "prepared")):
        if cand and (Path(cand) / "manifest.json").is_file():
            return Path(cand)
    return None


def _prepared_stats(path: Path, supervised_fraction: float | None) -> DataStats:
    manifest = read_manifest(path)
    splits = manifest.get("splits")
    train = splits.get("train", {}) if isinstance(splits, dict) else {}
    train = train if isinstance(train, dict) else {}
    try:
        from dflash_trainer.data.shards import PreparedDataset

        ds = PreparedDataset(path, "train")
        lengths = ds.lengths
        docs = len(ds)
        tokens = float(lengths.sum())
        sup = float(ds.supervised_counts().sum())
        first = ds.first_supervised()  # which documents the epoch leaves out
    except (DFlashError, ImportError, OSError, KeyError) as e:
        # Shards unreadable: the manifest's counts still give steps per epoch.
        docs = int(train.get("documents", 0))
        tokens = float(train.get("tokens", 0))
        sup = float(train.get("supervised_tokens", 0))
        lengths, first = None, None
        if not docs or not tokens:
            raise DFlashError(f"{path}: cannot read its documents ({e})") from e
    if not docs:
        raise DFlashError(f"{path}: the train split has no documents")
    frac = supervised_fraction or (sup / tokens if tokens and sup else DEFAULT_SUPERVISED_FRACTION)
    return DataStats(docs, lengths, tokens / docs, frac, f"{path}/manifest.json", first)


def check_plan_data(cfg: Config, data: str | None) -> None:
    """Refuse a prepared dataset made with another tokenizer than the target's, or holding
    ids outside its vocabulary (data/tokenizer_check.py); the tokenizer is compared when the
    target is on this machine, the ids always."""
    import sys

    from dflash_trainer.data.shards import read_manifest
    from dflash_trainer.data.tokenizer_check import (
        findings,
        load_target_tokenizer,
        refuse_mismatch,
    )
    from dflash_trainer.target.configs import load_target_config

    path = Path(data) if data else prepared_dir(cfg)
    if path is None:
        return
    try:
        manifest = read_manifest(path)
    except DFlashError:
        return  # data_stats said what it could read of it
    name = cfg.target.name_or_path
    local = name.startswith("asset:") or Path(name).exists()
    tokenizer = load_target_tokenizer(cfg.target) if local and manifest.get("tokenizer") else None
    vocab = int(load_target_config(cfg.target).vocab_size)

    def warn(message: str) -> None:
        print(f"dflash plan: note: {message}", file=sys.stderr)

    refuse_mismatch(findings(path, manifest, name, vocab, tokenizer), warn)
