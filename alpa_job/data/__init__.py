"""The job's input: datasets, fixed-shape batches and the streaming pipeline."""

from alpa_job.data.batching import EpochPlan, epoch_batches, plan_epoch
from alpa_job.data.memory import Dataset, cifar10_batch_files, load_cifar10, load_npz, synthetic

__all__ = ["Dataset", "EpochPlan", "cifar10_batch_files", "epoch_batches", "load_cifar10", "load_npz", "plan_epoch", "synthetic"]
