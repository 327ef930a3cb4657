import sys

from alpa_job.cli import main

sys.exit(main())
