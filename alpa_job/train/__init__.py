"""The one training loop and what it keeps beside it.

- loop.py: data -> engine step -> checkpoints -> progress -> the process's result (`train_process`);
- checkpoint.py: orbax checkpoints; rundir.py: the run directory (`--out`) and what it may hold;
- timing.py: steady-state step timing that never idles the device.
"""
