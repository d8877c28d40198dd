"""What every pod pays before its task runs: importing the workflow module (which imports every task module a
pod loads) and reading the bundled digits (plan_run's fingerprint, the stage task's source) import none of
scikit-learn, scipy, matplotlib and asyncssh. Each costs from 0.15 s to 1.5 s of CPU at import and is needed
only to draw a Deck's figures (matplotlib) or to reach a Slurm cluster (asyncssh); the digits file is read
without scikit-learn (traincore.data.digits).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
HEAVY = ("sklearn", "scipy", "matplotlib", "asyncssh")

# Prints which of the modules named in argv are imported after each step, as JSON.
PROBE = '''
import json, sys

def loaded():
    return sorted(name for name in sys.argv[1:] if name in sys.modules)

import workflows.pipeline  # noqa: F401
after_import = loaded()

from tasks.plan import fingerprint_source
from traincore.config import DataConfig
from traincore.data.sources import digits_source

fingerprint = fingerprint_source(DataConfig(source="digits"))
source = digits_source(DataConfig(source="digits"))
print(json.dumps({"import": after_import, "digits": loaded(), "fingerprint": fingerprint,
                  "count": source.count}))
'''


def test_a_pod_imports_no_library_it_does_not_use():
    run = subprocess.run([sys.executable, "-c", PROBE, *HEAVY], cwd=ROOT, capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    found = json.loads(run.stdout.strip().splitlines()[-1])
    assert found["import"] == [], "importing workflows.pipeline imported these"
    assert found["digits"] == [], "fingerprinting and reading the digits imported these"
    assert found["fingerprint"].startswith("digits:sha256:") and found["count"] == 1797
