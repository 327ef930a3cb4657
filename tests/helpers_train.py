"""Small helpers for the core training tests (tiny, fast configs on emulated CPU devices)."""

from __future__ import annotations

from alpa_job.models import model_values, size_settings
from alpa_job.settings.config import JobConfig

TINY = {
    "mlp": dict(hidden_dim=32),
    "wide_resnet": dict(depth=10, width=1),
    "gpt": dict(num_layers=1, d_model=32, num_heads=4, seq_len=16, vocab_size=64),
}


def tiny_config(model: str = "mlp", **overrides) -> JobConfig:
    """A tiny job of built-in `model` (or a builder's import path, its sizes given as model_args); its sizes
    (`num_layers=2`) may be overridden like any setting."""
    base = dict(
        model=model,
        num_samples=64,
        batch_size=16,
        epochs=1,
        address="none",
        devices=8,
        learning_rate=3e-3,
        out="/tmp/alpa-job-test",
        **TINY.get(model, {}),
    )
    base.update(overrides)
    return job_config(**base)


def job_config(**fields) -> JobConfig:
    """JobConfig(**fields) with a built-in's sizes among the fields (`num_layers=2`, as its flags give them)
    moved into model_args, validated and typed by the model's declaration, as a run resolves it."""
    sizes = {s.name for s in size_settings()}
    given = {k: fields.pop(k) for k in list(fields) if k in sizes}
    model_args = {**fields.pop("model_args", {}), **given}
    config = JobConfig(**fields, model_args=model_args).validated()
    return config.replace(model_args=model_values(config))


def signal_at_step(proc, step: int, sig: int, timeout: float = 120) -> str:
    """Send `sig` to a training subprocess (stderr piped, text, `--progress-every 1`) once it prints step
    `step`; returns all it printed on stderr. The process is killed if it outlives `timeout`."""
    seen = []
    try:
        for line in proc.stderr:
            seen.append(line)
            if line.startswith(f"[train] step {step}/"):
                proc.send_signal(sig)
                break
        rest = proc.communicate(timeout=timeout)[1]
    finally:
        if proc.poll() is None:
            proc.kill()
    return "".join(seen) + (rest or "")
