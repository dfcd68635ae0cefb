"""`prepare_dataset`: source -> read report -> chat template + masks -> split -> shards + manifest.

Idempotent: the manifest stores a fingerprint of (source content, tokenizer, settings); calling
again with the same inputs returns the existing directory after checking its checksums, so the
trainer can call it on every start. Atomic: everything is written to a temporary sibling
directory that is renamed into place at the end, so a killed run never leaves a directory that
looks prepared but is not.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from dflash_trainer.data.formats import Skip, read_records
from dflash_trainer.data.jsonio import HFDataset, input_files
from dflash_trainer.data.loading import load_tokenizer, resolve_source
from dflash_trainer.data.mixture import SourceTally, read_sidecar
from dflash_trainer.data.records import Conversation, ReadReport, Record, TokenizedRow
from dflash_trainer.data.shards import (
    DEFAULT_SHARD_TOKENS,
    FORMAT_NAME,
    FORMAT_VERSION,
    MANIFEST,
    PreparedDataset,
    ShardWriter,
    sha256_file,
)
from dflash_trainer.data.split import split_of
from dflash_trainer.data.stats import dataset_stats, format_stats, plot_lengths
from dflash_trainer.data.template import ChatTemplate, TemplatedDoc
from dflash_trainer.errors import DFlashError

SPLITS = ("train", "eval")


def _source_identity(resolved: Path | HFDataset) -> dict[str, Any]:
    if isinstance(resolved, HFDataset):
        return {"hf_dataset": resolved.name}
    root = resolved if resolved.is_dir() else resolved.parent
    return {
        "files": [
            {"name": str(p.relative_to(root)), "bytes": p.stat().st_size, "sha256": sha256_file(p)}
            for p in input_files(resolved)
        ]
    }


def _tokenizer_identity(tokenizer: Any, chat: ChatTemplate) -> dict[str, Any]:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    vocab = backend.to_str() if backend is not None else json.dumps(tokenizer.get_vocab())
    return {
        "name": str(tokenizer.name_or_path),
        "vocab_size": len(tokenizer),
        "vocab_sha256": hashlib.sha256(vocab.encode("utf-8")).hexdigest(),
        "chat_template_sha256": hashlib.sha256(tokenizer.chat_template.encode()).hexdigest(),
        "template_kwargs": chat.template_kwargs,
        "end_of_turn_id": chat.end_of_turn_id,
    }


def _fingerprint(*parts: Any) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()


def _batches(records: Iterator[Record], n: int) -> Iterator[list[Record]]:
    batch: list[Record] = []
    for r in records:
        batch.append(r)
        if len(batch) == n:
            yield batch
            batch = []
    if batch:
        yield batch


def _templated(
    batch: list[Record], chat: ChatTemplate, vocab_size: int
) -> Iterator[tuple[Record, TemplatedDoc | Skip]]:
    convs = [r for r in batch if isinstance(r, Conversation)]
    docs = iter(chat.tokenize(convs))
    for r in batch:
        if isinstance(r, TokenizedRow):
            ids = np.asarray(r.input_ids, dtype=np.int64)
            if ids.min() < 0 or ids.max() >= vocab_size:
                yield r, Skip("bad_tokens")
            else:
                yield r, TemplatedDoc(ids.astype(np.int32), np.asarray(r.loss_mask, dtype=bool))
        else:
            yield r, next(docs)


def _reuse(out: Path, fingerprint: str, overwrite: bool) -> bool:
    """True if `out` already holds this exact preparation, intact."""
    if not out.exists():
        return False
    mpath = out / MANIFEST
    if not mpath.is_file():
        if any(out.iterdir()):
            raise DFlashError(
                f"{out} exists and is not a prepared dataset; choose another --out "
                "(it is never deleted automatically)"
            )
        return False
    manifest = json.loads(mpath.read_text())
    if manifest.get("fingerprint") != fingerprint or manifest.get("version") != FORMAT_VERSION:
        if overwrite:
            return False
        raise DFlashError(
            f"{out} holds data prepared from another source, tokenizer or settings; "
            "use another --out, or pass overwrite=True (--overwrite) to replace it"
        )
    try:
        for split in manifest["splits"]:
            PreparedDataset(out, split).verify()
    except DFlashError as e:
        print(f"dflash data: {e}; rebuilding {out}", file=sys.stderr)
        return False
    return True


def prepare_dataset(
    source: str | Path,
    tokenizer: Any,
    out_dir: str | Path,
    fmt: str = "auto",
    max_records: int | None = None,
    max_tokens: int | None = None,
    eval_fraction: float = 0.02,
    template_kwargs: dict[str, Any] | None = None,
    shard_tokens: int = DEFAULT_SHARD_TOKENS,
    overwrite: bool = False,
    budget: int = 8192,
    batch_size: int = 256,
) -> Path:
    """Prepare `source` for training with `tokenizer`'s chat template into `out_dir`.

    `source`: a path, `asset:<name>` or `hf:<dataset>`; `tokenizer`: a tokenizer object or a
    spec for `load_tokenizer`. Documents over `max_tokens` are skipped (`too_long`). `budget`
    only feeds the statistics (documents over the trainer's token budget).
    """
    if not 0.0 <= eval_fraction < 1.0:
        raise DFlashError(f"eval_fraction must be in [0, 1), got {eval_fraction}")
    t0 = time.perf_counter()
    out = Path(out_dir)
    resolved = resolve_source(source)
    tok = load_tokenizer(tokenizer)
    chat = ChatTemplate.probe(tok, **(template_kwargs or {}))
    settings = {
        "fmt": fmt,
        "max_records": max_records,
        "max_tokens": max_tokens,
        "eval_fraction": eval_fraction,
        "shard_tokens": shard_tokens,
    }
    source_id = _source_identity(resolved)
    tok_id = _tokenizer_identity(tok, chat)
    fingerprint = _fingerprint(FORMAT_VERSION, source_id, tok_id, settings)
    if _reuse(out, fingerprint, overwrite):
        return out

    tmp = out.parent / f".{out.name}.tmp-{uuid.uuid4().hex[:8]}"
    tmp.mkdir(parents=True)
    try:
        report = ReadReport(source=str(source))
        tally = SourceTally()  # per `<source>/` id prefix (files from `dflash data prompts`)
        writers = {s: ShardWriter(tmp, s, shard_tokens) for s in SPLITS}
        records = read_records(
            resolved, fmt, report, require_assistant=True, max_records=max_records
        )
        for batch in _batches(records, batch_size):
            for record, doc in _templated(batch, chat, len(tok)):
                if isinstance(doc, Skip):
                    report.reject(doc.reason)
                    tally.reject(record.id, doc.reason)
                elif max_tokens is not None and len(doc.input_ids) > max_tokens:
                    report.reject("too_long")
                    tally.reject(record.id, "too_long")
                else:
                    tally.add(record.id, len(doc.input_ids), int(doc.loss_mask.sum()))
                    for kind in doc.repairs:
                        report.repair(kind)
                    doc_id = record.content_hash
                    writers[split_of(doc_id, eval_fraction)].add(
                        doc_id, doc.input_ids, doc.loss_mask
                    )
        entries = {s: w.close() for s, w in writers.items()}
        if report.kept == 0:
            raise DFlashError(
                f"no usable records in {source}:\n{report.format()}\n(prompts only? regenerate "
                "answers first with `dflash data regenerate`)"
            )
        manifest: dict[str, Any] = {
            "format": FORMAT_NAME,
            "version": FORMAT_VERSION,
            "fingerprint": fingerprint,
            "created_unix": int(time.time()),
            "source": {"spec": str(source), "resolved": str(resolved), **source_id},
            "tokenizer": {"spec": str(tokenizer) if isinstance(tokenizer, str | Path) else None}
            | tok_id,
            "settings": settings,
            "read_report": report.to_dict(),
            "sources": tally.to_dict(),
            "source_mixture": read_sidecar(resolved) if isinstance(resolved, Path) else None,
            "splits": {
                s: {
                    "documents": sum(e["documents"] for e in entries[s]),
                    "tokens": sum(e["tokens"] for e in entries[s]),
                    "supervised_tokens": sum(e["supervised_tokens"] for e in entries[s]),
                    "shards": entries[s],
                }
                for s in SPLITS
            },
        }
        _write_json(tmp / MANIFEST, manifest)
        _write_stats(tmp, budget)
        manifest["prepare_seconds"] = round(time.perf_counter() - t0, 2)
        _write_json(tmp / MANIFEST, manifest)
        _publish(tmp, out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)
    return out


def _write_json(path: Path, obj: Any) -> None:
    path.write_text(json.dumps(obj, indent=1) + "\n")


def _write_stats(root: Path, budget: int) -> None:
    texts, stats = [], {}
    for split in SPLITS:
        ds = PreparedDataset(root, split)
        s = dataset_stats(ds, budget)
        stats[split] = s.to_dict()
        texts.append(format_stats(s, f"[{split}]"))
        if split == "train":
            plot_lengths(ds.lengths, root / "lengths.png", budget, "train document lengths")
    (root / "stats.txt").write_text("\n\n".join(texts) + "\n")
    _write_json(root / "stats.json", stats)


def _publish(tmp: Path, out: Path) -> None:
    """Rename into place; an existing (replaced) directory is moved aside first, then removed."""
    old = None
    if out.exists():
        old = out.parent / f".{out.name}.old-{uuid.uuid4().hex[:8]}"
        os.replace(out, old)
    os.replace(tmp, out)
    if old is not None:
        shutil.rmtree(old)
