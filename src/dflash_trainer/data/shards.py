"""Tokenized documents on disk: memory-mapped shards, a manifest with checksums, streaming reads.

Layout of a prepared directory (see docs/data.md):

    manifest.json               what, from where, with which tokenizer, counts, checksums
    stats.txt, lengths.png      human-readable statistics
    train-00000/tokens.bin      int32 token ids of all documents of the shard, back to back
    train-00000/mask.bin        uint8 loss mask (1 = supervised), aligned with tokens.bin
    train-00000/offsets.npy     int64 [docs + 1]: document d is tokens[offsets[d]:offsets[d+1]]
    train-00000/doc_ids.npy     bytes [docs]: the stable document ids (sha1 of the content)
    eval-00000/...

Why raw memmaps and not Arrow/Parquet: the trainer reads single documents at random by index,
which a memmap serves with no decoding and no dependency (pyarrow is not one of ours); the page
cache keeps it fast, and nothing is loaded until touched. Why checksums per shard: a shard copied
to a node with a bad disk or cut short by a full disk is named, not discovered as a NaN loss.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from dflash_trainer.errors import DFlashError
from dflash_trainer.input_files import check_regular, inside, open_regular, read_small_bytes

MANIFEST = "manifest.json"
FORMAT_NAME = "dflash-prepared"
FORMAT_VERSION = 1
SHARD_FILES = ("tokens.bin", "mask.bin", "offsets.npy", "doc_ids.npy")
DEFAULT_SHARD_TOKENS = 64 * 1024 * 1024
"""64 Mi tokens: 256 MB of ids per shard, few files, still small enough to copy and verify."""


@dataclass(frozen=True)
class Document:
    input_ids: np.ndarray
    """int32 [T]"""
    loss_mask: np.ndarray
    """bool [T]: True where the token is supervised (assistant content and end of turn)."""
    doc_id: str


def sha256_file(path: Path, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open_regular(path, "file") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


class _OpenShard:
    """The shard being written: open files, running checksums, offsets and ids."""

    def __init__(self, directory: Path) -> None:
        directory.mkdir(parents=True)
        self.dir = directory
        self.tokens = open(directory / "tokens.bin", "wb")  # noqa: SIM115 (closed in finish)
        self.mask = open(directory / "mask.bin", "wb")  # noqa: SIM115
        self.sha_tokens = hashlib.sha256()
        self.sha_mask = hashlib.sha256()
        self.offsets = [0]
        self.doc_ids: list[str] = []
        self.supervised = 0

    def add(self, doc_id: str, input_ids: np.ndarray, loss_mask: np.ndarray) -> None:
        ids_b = np.ascontiguousarray(input_ids, dtype="<i4").tobytes()
        mask_b = np.ascontiguousarray(loss_mask, dtype=np.uint8).tobytes()
        self.tokens.write(ids_b)
        self.mask.write(mask_b)
        # Hash while writing: verifying later re-reads the files, writing need not.
        self.sha_tokens.update(ids_b)
        self.sha_mask.update(mask_b)
        self.offsets.append(self.offsets[-1] + len(input_ids))
        self.doc_ids.append(doc_id)
        self.supervised += int(loss_mask.sum())

    def finish(self) -> dict[str, Any]:
        """Close the files; the shard's manifest entry."""
        self.tokens.close()
        self.mask.close()
        np.save(self.dir / "offsets.npy", np.asarray(self.offsets, dtype=np.int64))
        np.save(self.dir / "doc_ids.npy", np.asarray(self.doc_ids, dtype=np.bytes_))
        sums = {
            "tokens.bin": self.sha_tokens.hexdigest(),
            "mask.bin": self.sha_mask.hexdigest(),
            "offsets.npy": sha256_file(self.dir / "offsets.npy"),
            "doc_ids.npy": sha256_file(self.dir / "doc_ids.npy"),
        }
        return {
            "name": self.dir.name,
            "documents": len(self.doc_ids),
            "tokens": self.offsets[-1],
            "supervised_tokens": self.supervised,
            "files": {
                f: {"bytes": (self.dir / f).stat().st_size, "sha256": sums[f]} for f in SHARD_FILES
            },
        }


class ShardWriter:
    """Appends documents of one split to shards of about `shard_tokens` tokens each."""

    def __init__(self, root: Path, split: str, shard_tokens: int = DEFAULT_SHARD_TOKENS) -> None:
        self.root, self.split, self.shard_tokens = root, split, shard_tokens
        self.entries: list[dict[str, Any]] = []
        self._open: _OpenShard | None = None

    def add(self, doc_id: str, input_ids: np.ndarray, loss_mask: np.ndarray) -> None:
        assert input_ids.shape == loss_mask.shape and input_ids.ndim == 1 and len(input_ids)
        if self._open is None:
            self._open = _OpenShard(self.root / f"{self.split}-{len(self.entries):05d}")
        self._open.add(doc_id, input_ids, loss_mask)
        if self._open.offsets[-1] >= self.shard_tokens:
            self.entries.append(self._open.finish())
            self._open = None

    def close(self) -> list[dict[str, Any]]:
        """Finish the open shard; the manifest entries of all shards of this split."""
        if self._open is not None:
            self.entries.append(self._open.finish())
            self._open = None
        return self.entries


def load_manifest(mpath: Path, fix: str) -> dict[str, Any]:
    """A manifest file's JSON object; a damaged or foreign file is a DFlashError ending in `fix`."""
    try:
        manifest = json.loads(read_small_bytes(mpath, "manifest"))
    except (OSError, ValueError, RecursionError) as e:  # JSON and UTF-8 errors are ValueErrors
        raise DFlashError(f"{mpath} is damaged: not readable JSON ({e}); {fix}") from e
    if not isinstance(manifest, dict):
        raise DFlashError(
            f"{mpath} is not a manifest: a JSON {type(manifest).__name__}, not an object; {fix}"
        )
    return manifest


def read_manifest(path: Path) -> dict[str, Any]:
    mpath = Path(path) / MANIFEST
    if not os.path.lexists(mpath):
        raise DFlashError(
            f"{path} is not a prepared dataset (no {MANIFEST}); create one with "
            "`dflash data prepare --input ... --out DIR`"
        )
    manifest = load_manifest(mpath, "prepare the data again")
    if manifest.get("format") != FORMAT_NAME or manifest.get("version") != FORMAT_VERSION:
        raise DFlashError(
            f"{mpath}: format {manifest.get('format')!r} version {manifest.get('version')!r}, "
            f"this dflash reads {FORMAT_NAME!r} version {FORMAT_VERSION}: prepare the data again"
        )
    return manifest


_AGAIN = "prepare the data again (or copy the directory again)"


def _load_npy(path: Path) -> np.ndarray:
    try:
        return np.load(path, allow_pickle=False)
    except (ValueError, OSError, EOFError) as e:
        raise DFlashError(f"{path}: not a readable .npy array ({e}); {_AGAIN}") from e


def _offsets(d: Path, n_tokens: int) -> np.ndarray:
    """The shard's document offsets, checked against its tokens: they start at 0, grow, and
    end at the token count, so no document reads outside tokens.bin."""
    off = _load_npy(d / "offsets.npy")
    ok = off.ndim == 1 and len(off) >= 1 and np.issubdtype(off.dtype, np.integer)
    ok = ok and int(off[0]) == 0 and int(off[-1]) == n_tokens and bool(np.all(np.diff(off) > 0))
    if not ok:
        raise DFlashError(
            f"{d / 'offsets.npy'}: offsets do not describe {n_tokens} tokens of documents "
            f"(damaged); {_AGAIN}"
        )
    return off.astype(np.int64)


class _Shard:
    """One shard, opened lazily: nothing is mapped until a document of it is read."""

    def __init__(
        self, root: Path, entry: dict[str, Any], id_range: tuple[int, int] | None = None
    ) -> None:
        where = f"{root / MANIFEST}: a shard entry"
        self.id_range = id_range
        """(lo, hi) token ids of the split, as its manifest records them (checked against the
        target's vocabulary before training): a document outside them was changed since."""
        files = entry.get("files") if isinstance(entry, dict) else None
        if not isinstance(files, dict) or sorted(files) != sorted(SHARD_FILES):
            raise DFlashError(f"{where} is damaged (files {SHARD_FILES} expected); {_AGAIN}")
        # The manifest names the shard: it must be a directory inside the prepared one.
        self.name: str = entry.get("name")  # type: ignore[assignment]
        self.dir = inside(root, self.name, f"{where} names a shard that")
        self.entry = entry
        for f, meta in files.items():
            p = inside(self.dir, f, f"shard {self.name}")
            if not os.path.lexists(p):
                raise DFlashError(f"shard {self.name}: {f} is missing from {self.dir}; {_AGAIN}")
            size = check_regular(p, f"shard {self.name}: file").st_size
            expected = meta.get("bytes") if isinstance(meta, dict) else None
            if size != expected:
                raise DFlashError(
                    f"shard {self.name}: {f} has {size} bytes, the manifest says "
                    f"{expected}: the shard is truncated or replaced; {_AGAIN}"
                )
        n_tokens, rest = divmod(files["tokens.bin"]["bytes"], 4)
        if rest or files["mask.bin"]["bytes"] != n_tokens:
            raise DFlashError(f"shard {self.name}: tokens.bin and mask.bin disagree; {_AGAIN}")
        self.offsets: np.ndarray = _offsets(self.dir, n_tokens)
        self._tokens: np.ndarray | None = None
        self._mask: np.ndarray | None = None
        self._doc_ids: np.ndarray | None = None

    def _map(self) -> None:
        self._tokens = np.memmap(self.dir / "tokens.bin", dtype="<i4", mode="r")
        # uint8 0/1 viewed as bool: no copy, same bytes.
        self._mask = np.memmap(self.dir / "mask.bin", dtype=np.uint8, mode="r").view(np.bool_)
        self._doc_ids = _load_npy(self.dir / "doc_ids.npy")
        if self._doc_ids.shape != (len(self.offsets) - 1,) or self._doc_ids.dtype.kind != "S":
            raise DFlashError(f"{self.dir / 'doc_ids.npy'}: not this shard's ids; {_AGAIN}")

    def document(self, j: int) -> Document:
        if self._tokens is None:
            self._map()
        assert self._tokens is not None and self._mask is not None and self._doc_ids is not None
        a, b = int(self.offsets[j]), int(self.offsets[j + 1])
        # Copies: a document is small, and a writable array avoids torch's read-only warning.
        ids = np.array(self._tokens[a:b], dtype=np.int32)
        if self.id_range is not None and len(ids):
            lo, hi = int(ids.min()), int(ids.max())
            if lo < self.id_range[0] or hi > self.id_range[1]:
                raise DFlashError(
                    f"shard {self.name}: document {j} holds token ids {lo}..{hi}, outside the "
                    f"range {list(self.id_range)} its manifest records: tokens.bin was changed "
                    f"after it was prepared (the model would index past its vocabulary); {_AGAIN}"
                )
        return Document(
            input_ids=ids,
            loss_mask=np.array(self._mask[a:b], dtype=np.bool_),
            doc_id=self._doc_ids[j].decode(),
        )

    def _mask_chunks(self, chunk: int) -> Iterator[tuple[int, np.ndarray, int, int]]:
        """The shard's loss mask `chunk` tokens at a time, for readers whose memory must not
        grow with the shard: (start offset, the chunk's mask, first and one-past-last
        document the chunk overlaps)."""
        if self._mask is None:
            self._map()
        assert self._mask is not None
        starts, ends = self.offsets[:-1], self.offsets[1:]
        total = int(self.offsets[-1])
        for lo in range(0, total, chunk):
            hi = min(lo + chunk, total)
            first = int(np.searchsorted(ends, lo, "right"))  # the document holding `lo`
            yield lo, self._mask[lo:hi], first, int(np.searchsorted(starts, hi))

    def supervised_counts(self, chunk: int = 1 << 22) -> np.ndarray:
        """int64 [n]: supervised tokens per document. The mask is summed `chunk` tokens at a
        time: memory stays bounded whatever the shard's size (the whole shard widened to
        int64 at once took 512 MB for a full one)."""
        starts = self.offsets[:-1]
        counts = np.zeros(len(starts), dtype=np.int64)
        for lo, mask, doc, past in self._mask_chunks(chunk):
            # The chunk's segments: from `lo` to the next document start, then one per
            # document starting inside it. Documents are never empty (offsets grow), so no
            # segment is empty (reduceat would give an element, not a sum, for one).
            bounds = np.concatenate([[0], starts[doc + 1 : past] - lo])
            # Summed as int64 (a uint8 sum would wrap): numpy widens the chunk to do it,
            # 8 bytes a token of the chunk (32 MiB at the default), never of the shard.
            sums = np.add.reduceat(mask.view(np.uint8), bounds, dtype=np.int64)
            counts[doc : doc + len(bounds)] += sums
        return counts

    def first_supervised(self, chunk: int = 1 << 22) -> np.ndarray:
        """int64 [n]: each document's first supervised position after its first token, or its
        length where it has none (no anchor of it has a supervised next token). The mask is
        read `chunk` tokens at a time: memory stays bounded whatever the shard's size."""
        starts, ends = self.offsets[:-1], self.offsets[1:]
        first = np.asarray(ends - starts, dtype=np.int64)
        found = np.zeros(len(starts), dtype=np.bool_)
        for lo, mask, doc, past in self._mask_chunks(chunk):
            pos = np.flatnonzero(mask) + lo
            if not len(pos):
                continue
            # The documents this chunk overlaps whose first supervised token is still unseen:
            # none of theirs lies before `lo`, so the first one in the chunk is theirs.
            docs = np.arange(doc, past)
            docs = docs[~found[docs]]
            k = np.searchsorted(pos, starts[docs] + 1)
            at = pos[np.minimum(k, len(pos) - 1)]
            hit = (k < len(pos)) & (at < ends[docs])
            first[docs[hit]] = at[hit] - starts[docs[hit]]
            found[docs[hit]] = True
        return first


class PreparedDataset:
    """Documents of one split of a prepared directory, read on demand from memory maps."""

    def __init__(self, path: str | Path, split: str = "train") -> None:
        self.path = Path(path)
        self.manifest = read_manifest(self.path)
        splits = self.manifest.get("splits")
        if not isinstance(splits, dict) or not all(isinstance(k, str) for k in splits):
            raise DFlashError(f"{self.path / MANIFEST}: no map of splits (damaged); {_AGAIN}")
        if split not in splits:
            raise DFlashError(f"{self.path} has no split {split!r}; it has {sorted(splits)}")
        self.split = split
        entries = splits[split].get("shards") if isinstance(splits[split], dict) else None
        if not isinstance(entries, list):
            raise DFlashError(f"{self.path / MANIFEST}: split {split!r} lists no shards; {_AGAIN}")
        rec = splits[split].get("token_ids")
        ok = isinstance(rec, list) and len(rec) == 2 and all(type(v) is int for v in rec)
        self._shards = [_Shard(self.path, e, (rec[0], rec[1]) if ok else None) for e in entries]
        counts = [len(s.offsets) - 1 for s in self._shards]
        self._starts = np.concatenate([[0], np.cumsum(counts, dtype=np.int64)])
        self.lengths: np.ndarray = (
            np.concatenate([np.diff(s.offsets) for s in self._shards])
            if self._shards
            else np.zeros(0, dtype=np.int64)
        )
        """int64 [N]: tokens per document, for token-budget batching without reading tokens."""

    def __len__(self) -> int:
        return int(self._starts[-1])

    def __getitem__(self, i: int) -> Document:
        n = len(self)
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError(f"document {i} out of range for {n} documents")
        k = int(np.searchsorted(self._starts, i, side="right")) - 1
        return self._shards[k].document(i - int(self._starts[k]))

    def iter_documents(self) -> Iterator[Document]:
        for shard in self._shards:
            for j in range(len(shard.offsets) - 1):
                yield shard.document(j)

    def supervised_counts(self) -> np.ndarray:
        """int64 [N]: supervised tokens per document."""
        if not self._shards:
            return np.zeros(0, dtype=np.int64)
        return np.concatenate([s.supervised_counts() for s in self._shards])

    def first_supervised(self) -> np.ndarray:
        """int64 [N]: per document, the first supervised position after position 0 (its
        length where none): the batcher leaves out documents whose kept window has none."""
        if not self._shards:
            return np.zeros(0, dtype=np.int64)
        return np.concatenate([s.first_supervised() for s in self._shards])

    def token_id_range(self) -> tuple[int, int]:
        """(smallest, largest) token id of the split, read from its shards; (0, -1) if empty."""
        lo, hi = None, None
        for shard in self._shards:
            if shard._tokens is None:
                shard._map()
            tokens = shard._tokens
            if tokens is not None and len(tokens):
                a, b = int(tokens.min()), int(tokens.max())
                lo, hi = (a, b) if lo is None or hi is None else (min(lo, a), max(hi, b))
        return (0, -1) if lo is None or hi is None else (lo, hi)

    def verify(self) -> None:
        """Recompute every shard file's sha256; raise DFlashError naming the first bad shard."""
        for shard in self._shards:
            for f, meta in shard.entry["files"].items():
                got = sha256_file(shard.dir / f)
                if got != meta["sha256"]:
                    raise DFlashError(
                        f"shard {shard.name} of {self.path}: {f} fails its checksum (sha256 "
                        f"{got[:12]}..., manifest {meta['sha256'][:12]}...): the file is "
                        "corrupted; prepare the data again (or copy the shard again)"
                    )
