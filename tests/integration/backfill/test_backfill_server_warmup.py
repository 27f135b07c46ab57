"""The backfill server's warm-up task does, ahead of the first backfill, the imports a range task's
first page would otherwise pay for (``backfill_app.prepare_range_worker``): it runs in a fresh
interpreter here, as in a new Python worker, and what it imported is read from ``sys.modules``."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

import pytest

CHECK = """
import json, sys
from sequin_provider.spark.backfill_app import prepare_range_worker
before = {name: name in sys.modules for name in MODULES}
count = list(prepare_range_worker(iter(range(3))))
print(json.dumps({"before": before, "after": {name: name in sys.modules for name in MODULES}, "count": count}))
"""

MODULES = ["pandas", "sequin_provider.sinks.webhook", "sequin_provider.sinks.nats_jetstream"]
"""What a range task's first page imported lazily: pandas (pyarrow's first array conversion) and the
destination kinds (parsing the config). The range reader itself comes with ``backfill_app``."""


@pytest.mark.skipif(importlib.util.find_spec("pandas") is None, reason="pyarrow imports pandas only when installed")
def test_the_warm_up_task_imports_what_a_range_tasks_first_page_would() -> None:
    out = subprocess.run(
        [sys.executable, "-c", f"MODULES = {MODULES!r}\n" + CHECK], capture_output=True, text=True, check=True
    )
    found = json.loads(out.stdout.strip().splitlines()[-1])
    assert found["before"] == dict.fromkeys(MODULES, False)  # none of it at the worker's start
    assert found["after"] == dict.fromkeys(MODULES, True)  # pyarrow's pandas and the destination kinds too
    assert found["count"] == [3]  # the task still counts its partition
