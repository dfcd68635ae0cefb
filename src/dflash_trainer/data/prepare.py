"""`prepare_dataset`: source -> read report -> chat template + masks -> split -> shards + manifest.

Idempotent: the manifest stores a fingerprint of (source content, tokenizer, settings); calling
again with the same inputs returns the existing directory after checking its checksums, so the
trainer can call it on every start. Atomic (atomic_dir): everything is written to a temporary
sibling directory that is renamed into place at the end, so a killed run never leaves a
directory that looks prepared but is not, and the next run removes what it left.

Never deletes what it did not write: an existing `out_dir` is replaced (with `overwrite`, or
when its shards are damaged) only if its manifest carries this tool's format marker and fields
and the directory holds nothing but the manifest, the statistics and the shards it lists.
"""

from __future__ import annotations

import hashlib
import json
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from dflash_trainer.atomic_dir import atomic_directory, check_replaceable, remove_stale
from dflash_trainer.data.formats import Skip, read_records
from dflash_trainer.data.guard import FILE_ERRORS, file_error
from dflash_trainer.data.jsonio import HFDataset, input_files
from dflash_trainer.data.loading import load_tokenizer, resolve_source
from dflash_trainer.data.loop_tails import LOOP_TAILS, LoopTally, mask_loop_tails, prepared_mode
from dflash_trainer.data.mixture import SourceTally, read_sidecar
from dflash_trainer.data.records import Conversation, ReadReport, Record, TokenizedRow
from dflash_trainer.data.shards import (
    DEFAULT_SHARD_TOKENS,
    FORMAT_NAME,
    FORMAT_VERSION,
    MANIFEST,
    PreparedDataset,
    ShardWriter,
    load_manifest,
    sha256_file,
)
from dflash_trainer.data.split import split_of
from dflash_trainer.data.stats import dataset_stats, format_stats, plot_lengths
from dflash_trainer.data.template import ChatTemplate, TemplatedDoc
from dflash_trainer.data.tokenizer_check import serialized_sha256, vocab_ids_sha256
from dflash_trainer.dir_lock import output_locked
from dflash_trainer.errors import DFlashError
from dflash_trainer.lineage.turns import RecordedTurns, encode, value_problem
from dflash_trainer.outputs import check_not_input

SPLITS = ("train", "eval")
RECORD_IDS = "record_ids.json.gz"
"""{split: {record id: assistant turns}}: which prompts each split holds and which of their
assistant turns it supervises (n: turns 1..n; a list when earlier turns are context only)."""
PREPARED_FILES = frozenset({MANIFEST, "stats.txt", "stats.json", "lengths.png", RECORD_IDS})


def _source_identity(resolved: Path | HFDataset) -> dict[str, Any]:
    if isinstance(resolved, HFDataset):
        return {"hf_dataset": resolved.name}
    root = resolved if resolved.is_dir() else resolved.parent
    files = []
    for p in input_files(resolved):
        try:
            files.append(
                {
                    "name": str(p.relative_to(root)),
                    "bytes": p.stat().st_size,
                    "sha256": sha256_file(p),
                }
            )
        except FILE_ERRORS as e:
            raise file_error(p, e) from e
    return {"files": files}


def _tokenizer_identity(tokenizer: Any, chat: ChatTemplate) -> dict[str, Any]:
    return {
        "name": str(tokenizer.name_or_path),
        "vocab_size": len(tokenizer),
        "vocab_sha256": serialized_sha256(tokenizer),
        "chat_template_sha256": hashlib.sha256(tokenizer.chat_template.encode()).hexdigest(),
        "template_kwargs": chat.template_kwargs,
        "end_of_turn_id": chat.end_of_turn_id,
    }


def _fingerprint(*parts: Any) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()


_Item = tuple[Record, frozenset[int]]
"""A record and its assistant turns kept as context only (a lineage trained on them)."""


def _batches(records: Iterator[_Item], n: int) -> Iterator[list[_Item]]:
    batch: list[_Item] = []
    for r in records:
        batch.append(r)
        if len(batch) == n:
            yield batch
            batch = []
    if batch:
        yield batch


def _templated(
    batch: list[_Item], chat: ChatTemplate, vocab_size: int
) -> Iterator[tuple[Record, frozenset[int], TemplatedDoc | Skip]]:
    convs = [(r, c) for r, c in batch if isinstance(r, Conversation)]
    docs = iter(chat.tokenize([r for r, _ in convs], [c for _, c in convs]))
    for r, context in batch:
        if isinstance(r, TokenizedRow):
            ids = np.asarray(r.input_ids, dtype=np.int64)
            if ids.min() < 0 or ids.max() >= vocab_size:
                yield r, context, Skip("bad_tokens")
            else:
                mask = np.asarray(r.loss_mask, dtype=bool)
                yield r, context, TemplatedDoc(ids.astype(np.int32), mask)
        else:
            yield r, context, next(docs)


@dataclass(frozen=True)
class _Inputs:
    """What a preparation is made from; `fingerprint` identifies it in the manifest."""

    source: str | Path
    resolved: Path | HFDataset
    tokenizer_spec: str | None
    tok: Any
    chat: ChatTemplate
    settings: dict[str, Any]
    source_id: dict[str, Any]
    tok_id: dict[str, Any]
    fingerprint: str


def _inputs(
    source: str | Path, tokenizer: Any, template_kwargs: dict[str, Any] | None, settings: dict
) -> _Inputs:
    resolved = resolve_source(source)
    tok = load_tokenizer(tokenizer)
    chat = ChatTemplate.probe(tok, **(template_kwargs or {}))
    source_id = _source_identity(resolved)
    tok_id = _tokenizer_identity(tok, chat)
    spec = str(tokenizer) if isinstance(tokenizer, str | Path) else None
    fingerprint = _fingerprint(FORMAT_VERSION, source_id, tok_id, settings)
    return _Inputs(source, resolved, spec, tok, chat, settings, source_id, tok_id, fingerprint)


# ---------------------------------------------------------------- what --out already holds


def _owned(manifest: dict[str, Any], mpath: Path) -> Callable[[str], bool]:
    """Which entry names of the directory this manifest's preparation wrote."""
    try:
        shards = {e["name"] for split in manifest["splits"].values() for e in split["shards"]}
    except (KeyError, TypeError, AttributeError) as e:
        raise DFlashError(
            f"{mpath}: the manifest's `splits` are damaged ({type(e).__name__}: {e}); its "
            "directory is not deleted: move it away or choose another --out"
        ) from e
    return lambda name: name in PREPARED_FILES or name in shards


def _existing(out: Path) -> dict[str, Any] | None:
    """The manifest of the prepared dataset in `out`; None if `out` is absent or empty.

    Anything else is a DFlashError, and nothing is deleted: a file, a directory without a
    manifest, a damaged manifest, or a manifest this tool did not write. (Extra files are
    checked by `_replaceable`, before a replacement: they do not stop a reuse.)
    """
    if not out.exists():
        return None
    if not out.is_dir():
        raise DFlashError(f"--out {out} is a file; give a directory path (it is created)")
    if not any(out.iterdir()):
        return None
    mpath = out / MANIFEST
    keep = f"{out} is not deleted, even with --overwrite: move it away or choose another --out"
    if not mpath.is_file():
        raise DFlashError(
            f"{out} exists and is not a prepared dataset; choose another --out "
            "(it is never deleted automatically)"
        )
    manifest = load_manifest(mpath, keep)
    marks = (manifest.get("format"), type(manifest.get("fingerprint")), manifest.get("splits"))
    if marks[0] != FORMAT_NAME or marks[1] is not str or not isinstance(marks[2], dict):
        raise DFlashError(
            f"{mpath} is not the manifest of a dataset prepared by dflash (format "
            f"{marks[0]!r:.40}, expected {FORMAT_NAME!r}); {keep}"
        )
    return manifest


def _replaceable(out: Path, manifest: dict[str, Any]) -> bool:
    """False, after checking that `out` holds nothing but what its manifest's run wrote."""
    check_replaceable(out, _owned(manifest, out / MANIFEST), "the prepared dataset it holds")
    return False


def _reuse(out: Path, fingerprint: str, overwrite: bool) -> bool:
    """True if `out` already holds this exact preparation, intact; False if it is to be
    written (absent, empty, or ours to replace); a DFlashError if it may not be touched."""
    manifest = _existing(out)
    if manifest is None:
        return False
    if manifest.get("fingerprint") != fingerprint or manifest.get("version") != FORMAT_VERSION:
        if overwrite:
            return _replaceable(out, manifest)
        raise DFlashError(
            f"{out} holds data prepared from another source, tokenizer or settings; "
            "use another --out, or pass overwrite=True (--overwrite) to replace it"
        )
    try:
        for split in manifest["splits"]:
            PreparedDataset(out, split).verify()
    except (DFlashError, KeyError, TypeError, ValueError) as e:
        print(f"dflash data: {e}; rebuilding {out}", file=sys.stderr)
        return _replaceable(out, manifest)
    return True


# ---------------------------------------------------------------- writing


def _turns(record: Record) -> int:
    """Assistant turns of a conversation; supervised spans of a pre-tokenized row."""
    if isinstance(record, Conversation):
        return sum(m["role"] == "assistant" for m in record.messages)
    mask = [bool(x) for x in record.loss_mask]
    return sum(1 for i, m in enumerate(mask) if m and (i == 0 or not mask[i - 1]))


class _Exclusion:
    """What a lineage already trained on, applied to the records read: a conversation keeps
    the assistant turns no continuation supervised, the others become context (their mask
    off); one with no new turn is skipped as `in_lineage`. A pre-tokenized row has no turns
    the template can name, so one whose id is recorded at all is skipped."""

    def __init__(self, recorded: RecordedTurns) -> None:
        self.recorded = recorded
        self.later_turns = 0
        """Records kept for turns after those recorded (their earlier turns context only)."""
        self.context_turns = 0

    def apply(
        self, records: Iterator[Record], report: ReadReport, tally: SourceTally
    ) -> Iterator[_Item]:
        for r in records:
            if r.id not in self.recorded:
                yield r, frozenset()
                continue
            turns = _turns(r)
            new = self.recorded.new_turns(r.id, turns) if isinstance(r, Conversation) else []
            if not new:
                report.reject("in_lineage")
                tally.reject(r.id, "in_lineage")
                continue
            context = frozenset(range(1, turns + 1)).difference(new)
            self.later_turns += 1
            self.context_turns += len(context)
            yield r, context

    def to_dict(self) -> dict[str, int]:
        return {
            "recorded_ids": len(self.recorded),
            "kept_for_later_turns": self.later_turns,
            "context_turns": self.context_turns,
        }


def _write_documents(
    root: Path, inp: _Inputs, batch_size: int, loops: LoopTally, exclude: _Exclusion | None
) -> tuple[ReadReport, SourceTally, dict[str, list[dict[str, Any]]]]:
    """Read, template and shard every record; the counts and each split's shard entries.

    With `exclude` (a lineage's records), turns it trained on are context, not supervised."""
    settings = inp.settings
    ids: dict[str, dict[str, int | list[int]]] = {s: {} for s in SPLITS}
    report = ReadReport(source=str(inp.source))
    tally = SourceTally()  # per `<source>/` id prefix (files from `dflash data prompts`)
    mask_loops = prepared_mode(settings) == "mask"
    writers = {s: ShardWriter(root, s, settings["shard_tokens"]) for s in SPLITS}
    records = read_records(
        inp.resolved, settings["fmt"], report, True, max_records=settings["max_records"]
    )
    max_tokens = settings["max_tokens"]
    items = (
        exclude.apply(records, report, tally) if exclude else ((r, frozenset()) for r in records)
    )
    for batch in _batches(items, batch_size):
        for record, context, doc in _templated(batch, inp.chat, len(inp.tok)):
            if mask_loops and not isinstance(doc, Skip):
                doc = mask_loop_tails(doc, loops)
            if isinstance(doc, Skip) or (
                max_tokens is not None and len(doc.input_ids) > max_tokens
            ):
                reason = doc.reason if isinstance(doc, Skip) else "too_long"
                report.reject(reason)
                tally.reject(record.id, reason)
                continue
            tally.add(record.id, len(doc.input_ids), int(doc.loss_mask.sum()))
            for kind in doc.repairs:
                report.repair(kind)
            doc_id = record.content_hash
            split = split_of(doc_id, settings["eval_fraction"])
            writers[split].add(doc_id, doc.input_ids, doc.loss_mask)
            supervised = set(range(1, _turns(record) + 1)) - context
            ids[split][record.id] = encode(supervised)
    write_record_ids(root, ids)
    return report, tally, {s: w.close() for s, w in writers.items()}


def write_record_ids(root: Path, ids: dict[str, dict[str, int | list[int]]]) -> None:
    import gzip

    with gzip.GzipFile(root / RECORD_IDS, "wb", mtime=0) as f:
        f.write(json.dumps(ids, sort_keys=True, ensure_ascii=False).encode("utf-8"))


def read_record_ids(root: str | Path, split: str = "train") -> dict[str, int | list[int]] | None:
    """{record id: assistant turns supervised (n: 1..n, or a list)} of one split; None for a
    directory prepared before the ids were kept (or written by hand)."""
    import gzip

    path = Path(root) / RECORD_IDS
    if not path.is_file():
        return None
    try:
        with gzip.open(path, "rt", encoding="utf-8") as f:
            ids = dict(json.load(f).get(split, {}))
    except (OSError, ValueError, AttributeError, TypeError) as e:
        raise DFlashError(f"{path}: damaged ({e}); prepare the directory again") from e
    for rid, turns in ids.items():
        problem = "null" if turns is None else value_problem(turns)
        if problem:
            raise DFlashError(f"{path}: the turns of {rid!r:.80} are damaged ({problem}); "
                              "prepare the directory again")  # fmt: skip
    return ids


def _manifest(
    inp: _Inputs,
    report: ReadReport,
    tally: SourceTally,
    entries: dict[str, list[dict[str, Any]]],
    loops: LoopTally,
) -> dict[str, Any]:
    resolved = inp.resolved
    return {
        "format": FORMAT_NAME,
        "version": FORMAT_VERSION,
        "fingerprint": inp.fingerprint,
        "created_unix": int(time.time()),
        "source": {"spec": str(inp.source), "resolved": str(resolved), **inp.source_id},
        # vocab_ids_sha256 is outside the fingerprint: directories prepared before it reuse.
        "tokenizer": {"spec": inp.tokenizer_spec}
        | inp.tok_id
        | {"vocab_ids_sha256": vocab_ids_sha256(inp.tok)},
        "settings": inp.settings,
        "read_report": report.to_dict(),
        "sources": tally.to_dict(),
        "loop_tails": loops.to_dict(prepared_mode(inp.settings)),
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
    loop_tails: str = "keep",
    exclude: RecordedTurns | None = None,
) -> Path:
    """Prepare `source` for training with `tokenizer`'s chat template into `out_dir`.

    `source`: a path, `asset:<name>` or `hf:<dataset>`; `tokenizer`: a tokenizer object or a
    spec for `load_tokenizer`. Documents over `max_tokens` are skipped (`too_long`). `budget`
    only feeds the statistics (documents over the trainer's token budget). `loop_tails`:
    "keep", or "mask" to take answers' repeating tails out of supervision (data/loop_tails.py).
    `exclude`: the (prompt id, assistant turn)s a drafter's lineage trained on: those turns
    are context only, and a record with no other turn is left out (`in_lineage`).
    """
    if not 0.0 <= eval_fraction < 1.0:
        raise DFlashError(f"eval_fraction must be in [0, 1), got {eval_fraction}")
    if loop_tails not in LOOP_TAILS:
        raise DFlashError(f"loop_tails must be one of {', '.join(LOOP_TAILS)}, got {loop_tails!r}")
    out = Path(out_dir)
    check_not_input(out, "--out", data=[source], replaced_whole=True)
    # One writer per output: a second prepare of the same --out is refused, naming the first.
    with output_locked(out, "dflash data prepare", f"prepared directory {out}"):
        t0 = time.perf_counter()
        remove_stale(out.parent, out.name)  # what a killed earlier run left, even if we reuse
        settings: dict[str, Any] = {
            "fmt": fmt,
            "max_records": max_records,
            "max_tokens": max_tokens,
            "eval_fraction": eval_fraction,
            "shard_tokens": shard_tokens,
        }
        if loop_tails != "keep":  # absent when kept: directories prepared before it stay valid
            settings["loop_tails"] = loop_tails
        exclusion = _Exclusion(exclude) if exclude else None
        if exclude:  # likewise absent without exclusion
            digest = hashlib.sha256("\n".join(exclude.lines()).encode("utf-8")).hexdigest()
            # "match": ids now match across a source prefix (lineage/turns.py), so a directory
            # prepared under exact matching is not reused as if it had been excluded alike.
            settings["exclude_turns"] = {
                "ids": len(exclude),
                "sha256": digest,
                "match": "across-source-prefix",
            }
        inp = _inputs(source, tokenizer, template_kwargs, settings)
        if _reuse(out, inp.fingerprint, overwrite):
            return out
        with atomic_directory(out, replace=True) as tmp:  # _reuse refused what is not ours
            loops = LoopTally()
            report, tally, entries = _write_documents(tmp, inp, batch_size, loops, exclusion)
            if report.kept == 0:
                raise DFlashError(
                    f"no usable records in {source}:\n{report.format()}\n(prompts only? "
                    "regenerate answers first with `dflash data regenerate`)"
                )
            manifest = _manifest(inp, report, tally, entries, loops)
            if exclusion is not None:
                manifest["lineage_exclusion"] = exclusion.to_dict()
            _write_json(tmp / MANIFEST, manifest)
            _write_stats(tmp, budget)
            for split in SPLITS:  # what the trainer checks against its target's vocabulary
                ids = PreparedDataset(tmp, split).token_id_range()
                manifest["splits"][split]["token_ids"] = list(ids)
            manifest["prepare_seconds"] = round(time.perf_counter() - t0, 2)
            _write_json(tmp / MANIFEST, manifest)
        return out


def _write_json(path: Path, obj: Any) -> None:
    path.write_text(json.dumps(obj, indent=1) + "\n", encoding="utf-8")


def _write_stats(root: Path, budget: int) -> None:
    texts, stats = [], {}
    for split in SPLITS:
        ds = PreparedDataset(root, split)
        s = dataset_stats(ds, budget)
        stats[split] = s.to_dict()
        texts.append(format_stats(s, f"[{split}]"))
        if split == "train":
            plot_lengths(ds.lengths, root / "lengths.png", budget, "train document lengths")
    (root / "stats.txt").write_text("\n\n".join(texts) + "\n", encoding="utf-8")
    _write_json(root / "stats.json", stats)
