"""The job's settings: the frozen `JobConfig`, its files (presets, `--config`), and the checks on them.

- config.py: `JobConfig`, presets (presets/*.yaml) and the override order;
- validate.py: everything the settings decide, checked before Ray starts.
"""
