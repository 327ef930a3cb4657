"""What the bench scripts share. A script runs as `python bench/NAME.py`, so Python puts bench/ first on
its path and finds this package beside it (the tests that check a bench script get bench/ from pytest's
pythonpath).

- ``checkout``: imported first by a script that imports the kit (alpa_job) or the test bed's package;
- ``results``: the one writer of results (bench/results/*.json, bench/RESULTS.md);
- ``table``: the plain-text table the scripts print and record.
"""
