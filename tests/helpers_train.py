"""Small helpers for the core training tests (tiny, fast configs on emulated CPU devices)."""
from __future__ import annotations

from alpa_job.settings.config import JobConfig

TINY = {
    "mlp": dict(hidden_dim=32),
    "wide_resnet": dict(depth=10, width=1),
    "gpt": dict(num_layers=1, d_model=32, num_heads=4, seq_len=16, vocab_size=64),
}


def tiny_config(model: str = "mlp", **overrides) -> JobConfig:
    base = dict(model=model, num_samples=64, batch_size=16, epochs=1, address="none", devices=8,
                learning_rate=3e-3, out="/tmp/alpa-job-test", **TINY[model])
    base.update(overrides)
    return JobConfig(**base).validated()
