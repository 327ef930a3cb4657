"""Makes the checkout importable for a bench script: the kit (alpa_job, at the root) and, where there is a
scripts/ folder, the test bed's package (scripts/kit_testbed). Python puts only bench/ on the path of
`python bench/NAME.py`, so a script that imports either imports this module first:

    from lib.checkout import REPO        # or `import lib.checkout` when it needs no REPO

A GPU machine gets a copy of alpa_job/, bench/, examples/ and pyproject.toml only: no scripts/ there,
and the gpu_* scripts need none.
"""

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

for _folder in (REPO / "scripts", REPO):  # the root ends first on the path: alpa_job from this checkout
    if _folder.is_dir() and str(_folder) not in sys.path:
        sys.path.insert(0, str(_folder))
