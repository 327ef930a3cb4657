"""A LLaMA-style decoder packaged for the kit: `python -m alpa_job train --model llama_example.model:build`."""
