"""The job's settings: the catalogue of them, the frozen `JobConfig`, its files (presets, `--config`), and the
checks on them.

- setting.py: `Setting`, the shape of one setting (what the catalogue lists and a model declares);
- catalog.py: every setting once, a model's own sizes from the model's declaration;
- config.py: `JobConfig` (a field per setting), presets (presets/*.yaml), the override order, coercion;
- validate.py: everything the settings decide, checked before Ray starts.
"""
