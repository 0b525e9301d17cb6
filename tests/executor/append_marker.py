"""A run_command target for tests: append one marker line to a workspace file (counts executions)."""

import os
import sys
import time

path, marker = sys.argv[1], sys.argv[2]
delay = float(sys.argv[3]) if len(sys.argv) > 3 else 0.0
with open(path, "a", encoding="utf-8") as out:
    out.write(marker + "\n")
    out.flush()
    os.fsync(out.fileno())
time.sleep(delay)  # widens the window between the side effect and FINISHED
