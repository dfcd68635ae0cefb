"""A prompt mixture: several sources read, decontaminated, capped, interleaved by weight.

`dflash data prompts --sources MIX.yaml --out prompts.jsonl` writes three files, each
atomically (a temporary sibling renamed into place, the prompts file last):
- `prompts.jsonl`: `{"id": "<source>/<id>", "messages": [...]}` per line, what
  `dflash data regenerate` (and `prepare`, for chat sources) reads;
- `prompts.jsonl.sources.json`: per-source counts (read, kept, skipped by reason, dropped by
  decontamination, over the cap, written) and the decontamination settings;
- `prompts.jsonl.decontam.jsonl`: one line per dropped record: id, source, the rule that
  dropped it, eval id, what matched (the shared n-gram, the signature, or the near-duplicate's
  containment) and `also`, the later rules that match it too.

Order: each source is shuffled by a seeded hash of its ids (so a cap, or any prefix of the
file, is a random subset and not the file's head), then sources are interleaved so that every
prefix of the output holds them in proportion to their weights until one runs out. Weights
never duplicate or drop records: `regenerate --max-records N` then takes a weighted mix.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

from dflash_trainer.atomic_dir import staged_file
from dflash_trainer.config import ConfigError, SourceConfig, config_from_dict, load_yaml
from dflash_trainer.data.decontam import RULES, EvalIndex
from dflash_trainer.data.records import Conversation
from dflash_trainer.data.sources import SourceReport, describe_skip, read_source
from dflash_trainer.errors import DFlashError
from dflash_trainer.input_files import check_regular, read_small_bytes
from dflash_trainer.lineage.turns import RecordedTurns
from dflash_trainer.outputs import locks_output

SIDECAR_FORMAT = "dflash-prompt-sources"
SIDECAR_VERSION = 1


def shipped_mixtures() -> list[str]:
    root = resources.files("dflash_trainer") / "recipes" / "sources"
    return sorted(p.name[:-5] for p in root.iterdir() if p.name.endswith(".yaml"))


def load_sources(spec: str | Path) -> tuple[SourceConfig, ...]:
    """Sources of a YAML file (`sources: [...]` or a whole config's `data.sources`), or of a
    mixture shipped in dflash_trainer/recipes/sources/ given by name."""
    path = Path(spec).expanduser()
    if path.exists() and not path.is_file():
        check_regular(path, "--sources")  # a directory, a FIFO, a device: said as such
    if not path.is_file():
        shipped = resources.files("dflash_trainer") / "recipes" / "sources" / f"{spec}.yaml"
        if not shipped.is_file():
            raise DFlashError(
                f"--sources {spec}: no such file and no shipped mixture of that name "
                f"(shipped: {shipped_mixtures()})"
            )
        path = Path(str(shipped))
    data = load_yaml(path)
    raw = data.get("sources") if "sources" in data else (data.get("data") or {}).get("sources")
    if not isinstance(raw, list) or not raw:
        raise DFlashError(f"{path}: expected a non-empty `sources:` list (or `data.sources`)")
    try:
        sources = config_from_dict({"data": {"sources": raw}}).data.sources
    except ConfigError as e:
        raise DFlashError(f"{path}: {e}") from e
    names = Counter(s.name for s in sources)
    dup = sorted(n for n, c in names.items() if c > 1)
    if dup:
        raise DFlashError(f"{path}: source names must be unique (they prefix ids): {dup}")
    return sources


def _order_key(seed: int, rid: str) -> str:
    return hashlib.sha1(f"{seed}:{rid}".encode()).hexdigest()


def interleave(streams: list[list[Conversation]], weights: list[float]) -> Iterator[Conversation]:
    """Smooth weighted round robin: next is the source whose (taken + 1) / weight is smallest."""
    taken = [0] * len(streams)
    live = [i for i, s in enumerate(streams) if s]
    while live:
        i = min(live, key=lambda j: ((taken[j] + 1) / weights[j], j))
        yield streams[i][taken[i]]
        taken[i] += 1
        if taken[i] == len(streams[i]):
            live.remove(i)


@dataclass
class Mixture:
    conversations: list[Conversation]
    reports: list[SourceReport]
    dropped: list[dict[str, Any]] = field(default_factory=list)
    """One entry per dropped record, as written to `OUT.decontam.jsonl`."""
    decontam: dict[str, Any] = field(default_factory=dict)


def _rule_order(counts: Counter[str]) -> dict[str, int]:
    return {r: counts[r] for r in RULES if counts[r]}


def build_mixture(
    sources: tuple[SourceConfig, ...] | list[SourceConfig],
    index: EvalIndex | None,
    seed: int = 0,
    exclude: RecordedTurns | None = None,
) -> Mixture:
    """Read every source, drop cross-source duplicates (the earlier source keeps it), drop
    contaminated records and those `exclude` (a lineage's records) trained on every turn of,
    apply caps, interleave by weight. A conversation with user turns after those the lineage
    trained on is kept (counted as `later_turns`): its earlier turns become context."""
    seen: set[str] = set()
    streams, reports = [], []
    dropped: list[dict[str, Any]] = []
    for src in sources:
        convs, report = read_source(src)
        kept = []
        for conv in convs:
            h = conv.content_hash
            if h in seen:
                report.kept -= 1
                report.skipped["duplicate"] += 1
                continue
            seen.add(h)
            if exclude and _all_turns_recorded(conv, exclude):
                report.in_lineage += 1
                continue
            hit = index.check(conv) if index is not None else None
            if hit is not None:
                report.decontaminated += 1
                report.decontaminated_by[hit.rule] += 1
                dropped.append(
                    {
                        "id": conv.id,
                        "source": src.name,
                        "rule": hit.rule,
                        "eval": hit.eval_id,
                        "match": hit.evidence,
                        "also": list(hit.also),
                    }
                )
                continue
            kept.append(conv)
        kept.sort(key=lambda c: _order_key(seed, c.id))
        if src.cap is not None and len(kept) > src.cap:
            report.over_cap = len(kept) - src.cap
            kept = kept[: src.cap]
        for conv in kept:
            report.later_turns += bool(exclude and conv.id in exclude)
            users = [m["content"] for m in conv.messages if m["role"] == "user"]
            report.user_turns += len(users)
            report.prompt_words += sum(len(u.split()) for u in users)
        report.written = len(kept)
        streams.append(kept)
        reports.append(report)
    mixed = list(interleave(streams, [s.weight for s in sources]))
    by_rule = Counter(d["rule"] for d in dropped)
    # What each rule alone would drop (a record matched by two rules counts under both).
    each_rule = Counter(r for d in dropped for r in [d["rule"], *d["also"]])
    per_source: dict[str, Counter[str]] = {}
    for d in dropped:
        per_source.setdefault(d["source"], Counter()).update([d["rule"], *d["also"]])
    info: dict[str, Any] = {
        "enabled": index is not None,
        "dropped": len(dropped),
        "dropped_by_rule": _rule_order(by_rule),
        "matched_by_rule": _rule_order(each_rule),
        "matched_by_rule_per_source": {k: _rule_order(v) for k, v in per_source.items()},
    }
    if index is not None:
        info |= index.settings()
    return Mixture(mixed, reports, dropped, info)


def _all_turns_recorded(conv: Conversation, exclude: RecordedTurns) -> bool:
    """Whether a lineage trained on every turn of `conv`: each user turn is answered by one
    assistant turn (regenerate answers them all), so its turns are its user turns."""
    users = sum(m["role"] == "user" for m in conv.messages)
    return conv.id in exclude and not exclude.new_turns(conv.id, users)


def _write_staged(held: contextlib.ExitStack, path: Path, lines: Iterator[str]) -> Path:
    """Write to a staged file of `path` (atomic_dir.staged_file, held until `held` closes);
    the caller renames it into place."""
    tmp = held.enter_context(staged_file(path))
    with open(tmp, "w", encoding="utf-8") as f:
        for line in lines:
            f.write(line)
        f.flush()
        os.fsync(f.fileno())
    return tmp


def sidecar_paths(out: Path) -> tuple[Path, Path]:
    return out.with_name(out.name + ".sources.json"), out.with_name(out.name + ".decontam.jsonl")


def _check_ours(out: Path) -> None:
    """Replace a prompts file and its two side files only if they are ours: the counts file
    says so. Anything else at those names (the sources YAML given as --out, a file of another
    program) is left as it is."""
    counts_path, log_path = sidecar_paths(out)
    present = [str(p) for p in (out, counts_path, log_path) if os.path.lexists(p)]
    if present and read_sidecar(out) is None:
        raise DFlashError(
            f"{', '.join(present)} already exist and are not a prompts file written by "
            f"`dflash data prompts` (no {counts_path.name} of its own beside it); nothing was "
            "replaced: move them aside or give another --out"
        )


@locks_output("out", "dflash data prompts", "the prompts file")
def write_mixture(mix: Mixture, out: Path, meta: dict[str, Any]) -> None:
    """prompts, counts and the drop log, each renamed into place (the prompts file last)."""
    _check_ours(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    counts_path, log_path = sidecar_paths(out)
    sidecar = {
        "format": SIDECAR_FORMAT,
        "version": SIDECAR_VERSION,
        **meta,
        "written": len(mix.conversations),
        "decontamination": mix.decontam,
        "sources": [r.to_dict() for r in mix.reports],
    }
    with contextlib.ExitStack() as held:  # the temporaries, removed however it ends
        log = (json.dumps(d, ensure_ascii=True) + "\n" for d in mix.dropped)
        temps = [(_write_staged(held, log_path, log), log_path)]
        counts = iter([json.dumps(sidecar, indent=1) + "\n"])
        temps.append((_write_staged(held, counts_path, counts), counts_path))
        rows = (
            json.dumps({"id": c.id, "messages": c.messages}, ensure_ascii=False) + "\n"
            for c in mix.conversations
        )
        temps.append((_write_staged(held, out, rows), out))
        for tmp, final in temps:
            os.replace(tmp, final)


def format_source_counts(sidecar: dict[str, Any]) -> str:
    """The per-source table of a prompts file's `.sources.json`."""
    lines = [
        f"{'source':<14} {'read':>8} {'kept':>8} {'decontam':>8} {'over cap':>8} "
        f"{'written':>8} {'turns':>8} {'words':>10}  skipped"
    ]
    for s in sidecar["sources"]:
        skipped = ", ".join(
            f"{r} {n}" for r, n in sorted(s["skipped"].items(), key=lambda kv: -kv[1])
        )
        lines.append(
            f"{s['name']:<14} {s['records']:>8,} {s['kept']:>8,} {s['decontaminated']:>8,} "
            f"{s['over_cap']:>8,} {s['written']:>8,} {s['user_turns']:>8,} "
            f"{s['prompt_words']:>10,}  {skipped or '-'}"
        )
    reasons = sorted({r for s in sidecar["sources"] for r in s["skipped"]})
    lines += [f"  {r}: {describe_skip(r)}" for r in reasons]
    lines += _decontam_lines(sidecar)
    lines.append(f"written: {sidecar['written']:,} conversations")
    return "\n".join(lines)


def _by_rule(counts: dict[str, int]) -> str:
    return ", ".join(f"{rule} {counts[rule]}" for rule in RULES if counts.get(rule)) or "-"


def _decontam_lines(sidecar: dict[str, Any]) -> list[str]:
    """The decontamination summary: settings, drops per rule, and per rule of each source."""
    d = sidecar.get("decontamination", {})
    if not d.get("enabled"):
        return ["decontamination: off"]
    rules = d.get("rules", ["ngram"])  # files written before the other rules: n-grams only
    several = len(rules) > 1 and "matched_by_rule" in d
    each = f"; each rule alone: {_by_rule(d['matched_by_rule'])}" if several else ""
    lines = [
        f"decontamination: {d['dropped']} dropped ({_by_rule(d.get('dropped_by_rule', {'ngram': d['dropped']}))}"
        f"{each}) by {', '.join(rules)} against {d['eval_texts']}: {d['ngram']}-word n-grams "
        f"({d['eval_ngrams']:,})"
        + (f", {d['eval_signatures']} signatures" if "signature" in rules else "")
        + (
            f", near duplicates at containment >= {d['near_duplicate']['containment']}"
            if "near_duplicate" in rules
            else ""
        )
    ]
    for s in sidecar["sources"]:
        if s.get("decontaminated"):
            alone = d.get("matched_by_rule_per_source", {}).get(s["name"])
            tail = f" (each rule alone: {_by_rule(alone)})" if several and alone else ""
            first = s.get("decontaminated_by", {"ngram": s["decontaminated"]})
            lines.append(f"  {s['name']}: {_by_rule(first)}{tail}")
    return lines


# ---------------------------------------------------------------- prepared datasets


def source_of(record_id: str) -> str | None:
    """The source prefix of a mixed record id (`asdiv/17` -> `asdiv`), else None."""
    head, sep, _ = record_id.partition("/")
    return head if sep and head else None


class SourceTally:
    """Per-source documents, tokens and rejections of `prepare_dataset`, by id prefix."""

    def __init__(self) -> None:
        self.by_source: dict[str, dict[str, Any]] = {}

    def _row(self, record_id: str) -> dict[str, Any] | None:
        name = source_of(record_id)
        if name is None:
            return None
        return self.by_source.setdefault(
            name, {"documents": 0, "tokens": 0, "supervised_tokens": 0, "rejected": {}}
        )

    def add(self, record_id: str, tokens: int, supervised: int) -> None:
        row = self._row(record_id)
        if row is not None:
            row["documents"] += 1
            row["tokens"] += tokens
            row["supervised_tokens"] += supervised

    def reject(self, record_id: str, reason: str) -> None:
        row = self._row(record_id)
        if row is not None:
            row["rejected"][reason] = row["rejected"].get(reason, 0) + 1

    def to_dict(self) -> dict[str, Any]:
        return dict(sorted(self.by_source.items()))


def read_sidecar(path: Path) -> dict[str, Any] | None:
    """The `.sources.json` next to a prompts file, if there is one."""
    counts_path, _ = sidecar_paths(path)
    if not counts_path.is_file():
        return None
    try:
        data: dict[str, Any] = json.loads(read_small_bytes(counts_path, "sources sidecar"))
    except (ValueError, RecursionError) as e:
        raise DFlashError(
            f"{counts_path} is damaged ({e}); run `dflash data prompts` again or delete it"
        ) from e
    if not isinstance(data, dict) or data.get("format") != SIDECAR_FORMAT:
        return None
    return data


def format_prepared_sources(by_source: dict[str, Any]) -> str:
    lines = [f"{'source':<14} {'documents':>10} {'tokens':>14} {'supervised':>14}  rejected"]
    for name, row in by_source.items():
        rejected = ", ".join(f"{r} {n}" for r, n in sorted(row["rejected"].items())) or "-"
        lines.append(
            f"{name:<14} {row['documents']:>10,} {row['tokens']:>14,} "
            f"{row['supervised_tokens']:>14,}  {rejected}"
        )
    return "\n".join(lines)
