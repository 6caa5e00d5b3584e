"""Run every bench/bench_*.py in turn (`make bench`). Each prints its own figures."""

import subprocess
import sys
from pathlib import Path

here = Path(__file__).resolve().parent
failed = 0
for script in sorted(here.glob("bench_*.py")):
    print(f"== {script.name}", flush=True)
    failed |= subprocess.call([sys.executable, str(script)], cwd=here.parent)
sys.exit(failed)
