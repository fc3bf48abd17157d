"""Write the JSON fixtures of the report tests: what ``remat report gpt --budget 90%`` measures on a
small GPT (the sizes of ``conftest.SIZES``, one timing round), into ``tests/report/fixtures/``.

The report tests read these files instead of profiling, benching and recording timelines each run.
Run it again, from the repository root, when a file format changes (a new ``schema_version``)::

    OMP_NUM_THREADS=1 .venv/bin/python -m tests.report.make_fixtures
"""

from __future__ import annotations

import remat
from remat.models import workload
from remat.report import collect
from tests.report.conftest import BUDGET, FIXTURES, SIZES


def main() -> None:
    """Measure the small GPT's report values and write them as JSON into ``FIXTURES``."""
    w = workload("gpt", **SIZES)
    prof = remat.profile(w.model, w.inputs, w.loss_fn, repeats=1)
    data = collect(w.model, w.inputs, w.loss_fn, budget=BUDGET, profile=prof, rounds=1, description=w.description)
    for path in data.write(FIXTURES):
        print(f"wrote {path} ({path.stat().st_size} bytes)")


if __name__ == "__main__":
    main()
