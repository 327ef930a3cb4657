"""Hugging Face checkpoints in and out: `--init-from hf:DIR` starts a run from a checkpoint's weights, `python -m
alpa_job hf export RUN DIR` writes a run's back as one, `hf logits DIR` prints the kit's logits for given tokens.

- checkpoint.py: a checkpoint folder (config.json + *.safetensors), read slice by slice and written back;
- layout.py: a model's parameters as the checkpoint's tensors (the model's api.HfWeights) and the checks that
  a checkpoint fits the model, run in the driver before Ray;
- load.py: the parameters made straight into their shardings, each device reading only its own slice.
The `hf` command (export, logits) is alpa_job/hf_commands.py: it reads runs and builds models, above this.
"""
