"""``python bench/matmul_crossover.py [flags]``: the suite's ``crossover`` benchmark as a script.

The same as ``python -m bench crossover [flags]``; kept as a command because ci/gpu.sh and
users run it by this path.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.__main__ import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(["crossover", *sys.argv[1:]]))
