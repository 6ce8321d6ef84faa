"""Inspect fx-engine's compiled steps and a traced run (the same as `fx-engine trace`).

    python tools/trace.py                     # graphs + a traced run of the default model -> trace-out/
    python tools/trace.py graphs --rows 8 --capacity 1024 --out a
    python tools/trace.py diff a/graphs.json b/graphs.json
    python tools/trace.py run --requests 16 --out run1

See fx_engine/tracing/cli.py for every option.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from fx_engine.tracing.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
