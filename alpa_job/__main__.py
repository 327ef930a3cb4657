import traceback

from alpa_job.cli import main
from alpa_job.shutdown import exit_within

try:
    code = main()
except SystemExit as done:  # argparse's --help, and anything else that exits on purpose
    code = done.code
except BaseException:  # a bug: its traceback, then the same bounded exit as every other ending
    traceback.print_exc()
    code = 1
exit_within(code)  # never waits forever on a background thread that cannot end (alpa_job/shutdown.py)
