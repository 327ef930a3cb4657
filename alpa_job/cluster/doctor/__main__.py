"""`python -m alpa_job.cluster.doctor [flags]`: the same as `python -m alpa_job doctor [flags]`."""
import sys

from alpa_job.cli import main

sys.exit(main(["doctor"] + sys.argv[1:]))
