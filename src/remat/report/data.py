"""What a report is drawn from, as values: the profile, the plan, the bench, the frontier and the timelines.

A report reads values and never measures or plans (issue #8, "one-way pipeline"): :class:`ReportData`
holds every value the charts, tables and documents draw, and writes them as the JSON files of the
stages that made them, so that ``remat report --from DIR`` draws the same report again without a model.

# NOTE [ Report files ]
A report directory holds, besides the documents and charts, one JSON file per value, each read back
by its own ``from_json`` (NOTE [ One loading policy ] in ``remat._json``):

    profile.json       Profile        (schema_version 1)   remat.profile / `remat profile`
    plan.json          Plan           (schema_version 1)   the plan the report is about
    bench.json         BenchResult    (schema_version 1)   remat.measure.compare.compare / `remat bench --json`
    frontier.json      Frontier       (schema_version 1)   remat.frontier
    timeline-1.json …  Timeline       (schema_version 1)   remat.timeline, one file each, in drawing order

``remat bench --out DIR`` writes the same files without timelines; its plan is the one its heatmap
shows (:func:`heatmap_plan`).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from remat._json import write_atomic
from remat.errors import RematError
from remat.measure.compare import BenchResult
from remat.measure.timeline import Timeline
from remat.plan.frontier import Frontier
from remat.plan.types import Plan
from remat.profile.types import Profile

__all__ = ["ReportData", "heatmap_plan", "PROFILE_JSON", "PLAN_JSON", "BENCH_JSON", "FRONTIER_JSON", "timeline_json"]

PROFILE_JSON = "profile.json"
PLAN_JSON = "plan.json"
BENCH_JSON = "bench.json"
FRONTIER_JSON = "frontier.json"

_TIMELINE = re.compile(r"timeline-(\d+)\.json")

T = TypeVar("T")


def heatmap_plan(result: BenchResult) -> Plan | None:
    """The plan a bench's charts show in the heatmap, picked from the bench's rows (each carries the plan
    it measured), never solved again.

    Args:
        result: The bench.

    Returns:
        Of the plans the optimal solver made, the one whose budget is the tightest that its measured
        peak fits (the tightest of all if none fits); ``None`` when the bench has no plan of the optimal
        solver (or was read from a file written before rows carried their plans).
    """
    solved = [r for r in result.rows if r.solver == "optimal" and r.plan is not None and r.budget_bytes is not None]
    fitting = [r for r in solved if r.budget_bytes is not None and r.peak_bytes <= r.budget_bytes]
    candidates = fitting or solved
    if not candidates:
        return None
    return min(candidates, key=lambda r: r.budget_bytes or 0).plan


def timeline_json(number: int) -> str:
    """The file name of the ``number``-th timeline of a report (from 1), e.g. ``"timeline-1.json"``."""
    return f"timeline-{number}.json"


@dataclass(frozen=True)
class ReportData:
    """Every value a report draws (NOTE [ Report files ]).

    Attributes:
        profile: From ``remat.profile``.
        plan: The plan the report is about (the chosen plan; the heatmap draws it).
        result: The bench of every plan (``remat.measure.compare.compare``), the plain model first.
        frontier: From ``remat.frontier(profile)``.
        timelines: From ``remat.timeline``, e.g. of the plain model, ``full`` and the plan (may be empty:
            the timeline chart and table are then left out).
    """

    profile: Profile
    plan: Plan
    result: BenchResult
    frontier: Frontier
    timelines: tuple[Timeline, ...] = ()

    def write(self, directory: str | Path) -> list[Path]:
        """Write each value as its JSON file into ``directory`` (created if missing), atomically.

        Timeline files of an earlier report that this one does not have are removed, so that
        :meth:`read` finds exactly these timelines.

        Returns:
            The paths written, in the order of NOTE [ Report files ].
        """
        d = Path(directory)
        d.mkdir(parents=True, exist_ok=True)
        texts = {
            PROFILE_JSON: self.profile.to_json(),
            PLAN_JSON: self.plan.to_json(),
            BENCH_JSON: self.result.to_json(),
            FRONTIER_JSON: self.frontier.to_json(),
        }
        texts.update({timeline_json(i): tl.to_json() for i, tl in enumerate(self.timelines, 1)})
        for stale in _timeline_files(d)[len(self.timelines) :]:
            stale.unlink()
        paths = []
        for name, text in texts.items():
            write_atomic(d / name, text)
            paths.append(d / name)
        return paths

    @classmethod
    def read(cls, directory: str | Path) -> ReportData:
        """The values in ``directory``, as :meth:`write` (or ``remat bench --out``) wrote them.

        ``plan.json`` may be missing: the plan is then the one :func:`heatmap_plan` picks from the bench. Timeline files may be missing.

        Raises:
            RematError: If the directory lacks a file the report needs, or a file is not valid (its
                ``from_json`` names the file kind, the field and the fix).
        """
        d = Path(directory)
        if not d.is_dir():
            raise RematError(f"report: {str(d)!r} is not a directory; {_FIX}")
        profile = _read(d / PROFILE_JSON, Profile.from_json)
        result = _read(d / BENCH_JSON, BenchResult.from_json)
        frontier = _read(d / FRONTIER_JSON, Frontier.from_json)
        if (d / PLAN_JSON).exists():
            plan = _read(d / PLAN_JSON, Plan.from_json)
        else:
            picked = heatmap_plan(result)
            if picked is None:
                raise RematError(
                    f"report: {str(d)!r} has no {PLAN_JSON} and its bench has no optimal plan to report on; "
                    f"write the plan there with `remat plan MODEL --budget 40% --out {d / PLAN_JSON}`"
                )
            plan = picked
        timelines = tuple(_read(p, Timeline.from_json) for p in _timeline_files(d))
        return cls(profile, plan, result, frontier, timelines)


_FIX = "give a directory written by `remat report MODEL --budget 40% --out DIR` or `remat bench MODEL --out DIR`"


def _timeline_files(directory: Path) -> list[Path]:
    """The timeline files in ``directory``, by number."""
    found = [(int(m[1]), p) for p in directory.iterdir() if (m := _TIMELINE.fullmatch(p.name))]
    return [p for _, p in sorted(found)]


def _read(path: Path, from_json: Callable[[str], T]) -> T:
    """The value in the JSON file ``path``, read by ``from_json``; a missing file is a RematError."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise RematError(f"report: {str(path.parent)!r} has no {path.name}; {_FIX}") from None
    except OSError as e:
        raise RematError(f"report: cannot read {str(path)!r}: {e.strerror}; check the path") from None
    return from_json(text)
