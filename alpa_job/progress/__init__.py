"""Progress a trainer can watch: events from the training process, one display on the driver.

One module per job, each imported by the code that does that job:
  events.py    the bus the producers call (`Progress`, `phase`, `note`, `timed`, `metrics`) and this
               process's sink; imported by training processes and the Alpa engine, so it loads neither
               Ray nor rich;
  display.py   the driver's display: a rich progress bar on a TTY, plain lines elsewhere, train.log;
  channel.py   process 0's events across Ray to the driver (`ProgressChannel`, batched in the actor);
  ray_logs.py  Ray's own output kept out of the user's way (its environment, loggers, native stderr).

This file imports none of them: importing one part never loads another's dependencies.
Python 3.9-compatible (the Alpa image), rich optional.
"""
