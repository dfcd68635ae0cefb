"""What every doctor check returns (`Check`) and the report `dflash doctor` prints."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Literal

Status = Literal["pass", "warn", "fail", "skip"]

_MARK = {"pass": "PASS", "warn": "WARN", "fail": "FAIL", "skip": "SKIP"}


@dataclass(frozen=True)
class Check:
    id: str
    status: Status
    message: str
    fix: str = ""


@dataclass
class DoctorReport:
    checks: list[Check] = field(default_factory=list)

    @property
    def failed(self) -> bool:
        return any(c.status == "fail" for c in self.checks)

    @property
    def failures(self) -> list[Check]:
        return [c for c in self.checks if c.status == "fail"]

    @property
    def warnings(self) -> list[Check]:
        return [c for c in self.checks if c.status == "warn"]

    def get(self, check_id: str) -> list[Check]:
        return [c for c in self.checks if c.id == check_id]

    def format(self) -> str:
        lines = []
        for c in self.checks:
            lines.append(f"[{_MARK[c.status]}] {c.id}: {c.message}")
            if c.fix and c.status in ("warn", "fail", "skip"):
                lines.append(f"        fix: {c.fix}")
        n = {s: sum(c.status == s for c in self.checks) for s in _MARK}
        lines.append(
            f"doctor: {n['fail']} fail, {n['warn']} warn, {n['pass']} pass, {n['skip']} skipped"
        )
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        return {"failed": self.failed, "checks": [asdict(c) for c in self.checks]}
