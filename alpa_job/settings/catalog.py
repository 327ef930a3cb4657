"""The catalogue: every job setting once, in `JobConfig`'s field order.

`JobConfig`'s fields, the `train` parser's flags and `--help` lines, the coercion of `--config`
values, and the bounds and allowed names checked by `JobConfig.validated` are all read from here.
A model's own settings are not here: every model, built-in or brought, keeps them in `model_args`,
which its builder's declaration types (alpa_job/api.py; the built-ins' size flags are spellings of
`--model-arg`). This package imports no model and no jax.
"""

from __future__ import annotations

from typing import Dict, Optional, Tuple

from alpa_job import strategies as strategy_records
from alpa_job.setting import ABOVE_ZERO, CLUSTER, NON_NEGATIVE, OUTPUT, PARALLELISM, POSITIVE, ModelArgs, Setting, Switch

DATASETS = ("synthetic", "cifar10", "tokens", "array_record", "npz", "model")
FILE_DATASETS = ("tokens", "array_record", "npz", "model")  # read --data-path / --eval-data-path
TOKEN_DTYPES = ("uint16", "uint32")
ENGINES = ("auto", "jax", "alpa")
STRATEGIES = (*strategy_records.STRATEGIES, strategy_records.AUTO)  # --engine jax
ALPA_STRATEGIES = ("data", "shard", "pipeshard-manual", "pipeshard-auto")  # --engine alpa
DTYPES = ("float32", "bfloat16")
REMAINDER_POLICIES = ("drop", "pad")
TRACKERS = ("none", "mlflow", "wandb")  # --track

WHAT_TO_TRAIN = (
    # Checked by models.check_model_name: a built-in, an installed model, or PACKAGE.MODULE:FUNCTION.
    Setting(
        "model", str, "mlp", "what to train: a built-in, an installed model, or your own builder as PACKAGE.MODULE:FUNCTION", metavar="NAME"
    ),
    Setting(
        "dataset",
        str,
        "synthetic",
        "synthetic (generated), cifar10 (local), tokens (binary token files), "
        "array_record (serialized examples), npz (arrays by field), model (the model's own Grain dataset)",
        choices=DATASETS,
    ),
    # cifar10 reads data_batch_1..5 (python format) from it; the kit never downloads at run time.
    Setting("data_dir", Optional[str], None, "cifar10: the extracted cifar-10-batches-py folder", metavar="DIR", decides_step=False),
    Setting(
        "data_path",
        Optional[str],
        None,
        "tokens / array_record / npz / model: a file, a folder or a quoted glob",
        metavar="PATH",
        decides_step=False,
    ),
    Setting("token_dtype", str, "uint16", "tokens: the id type of the token files", choices=TOKEN_DTYPES, decides_step=False),
    Setting(
        "eval_data_path",
        Optional[str],
        None,
        "the eval split, in --dataset's format: its loss (and perplexity for tokens) in the progress line and the report",
        metavar="PATH",
        decides_step=False,
    ),
    Setting("eval_every", int, 0, "evaluate every N steps (0: at the end only)", check=NON_NEGATIVE, metavar="N", decides_step=False),
    Setting(
        "eval_batches",
        Optional[int],
        None,
        "batches per evaluation",
        check=POSITIVE,
        metavar="K",
        default_help="the whole eval split",
        decides_step=False,
    ),
    Setting(
        "data_threads", int, 2, "background threads reading batches ahead of the step", check=POSITIVE, metavar="N", decides_step=False
    ),
    Setting("prefetch", int, 4, "batches read ahead", check=POSITIVE, metavar="N", decides_step=False),
    # The default over the default batch leaves a ragged last batch on purpose.
    Setting("num_samples", int, 2000, "synthetic dataset size", check=POSITIVE, decides_step=False),
    Setting("batch_size", int, 256, "global batch, split over the data-parallel axis", check=POSITIVE),
    Setting("epochs", int, 3, "passes over the dataset", check=POSITIVE, decides_step=False),
    Setting("steps", Optional[int], None, "stop after N steps", check=POSITIVE, default_help="all epochs", decides_step=False),
    Setting(
        "remainder",
        str,
        "drop",
        "a ragged last batch: drop it, or pad it and mask the loss",
        choices=REMAINDER_POLICIES,
        switches=(
            Switch("--drop-remainder", "drop", "drop a ragged last batch (default)"),
            Switch("--pad-remainder", "pad", "pad a ragged last batch and mask it out of the loss"),
        ),
    ),
    Setting("learning_rate", float, 1e-3, "Adam learning rate", check=ABOVE_ZERO, metavar="LR"),
    Setting("dtype", str, "float32", "compute dtype", choices=DTYPES),
    Setting(
        "precision",
        str,
        "dtype",
        "jax: the dense layers' products: in --dtype, or fp8 (e4m3 forward, e5m2 "
        "gradients, per-tensor scales of this step; the rest stays bf16; needs --dtype bfloat16 and fp8 tensor "
        "cores: Ada or Hopper; emulated on CPU)",
        choices=("dtype", "fp8"),
    ),
    Setting("seed", int, 0, "parameters and data order", metavar="SEED", decides_step=False),
)

HOW_TO_RUN = (
    Setting("engine", str, "auto", "auto: alpa when it imports, else jax", PARALLELISM, choices=ENGINES),
    Setting(
        "strategy",
        str,
        "data",
        f"jax: {' | '.join(STRATEGIES)}; alpa: {' | '.join(ALPA_STRATEGIES)}",
        PARALLELISM,
        choices=tuple(dict.fromkeys(STRATEGIES + ALPA_STRATEGIES)),
    ),
    Setting(
        "data_update",
        str,
        "sharded",
        "data: sharded (each device keeps and updates its share of the parameters "
        "and of the optimizer state; a step gathers the parameters whole in the dtype the model reads them in, "
        "bf16 under --dtype bfloat16, and reduce-scatters the gradients) or replicated (every device keeps "
        "every parameter, sums every gradient and updates every parameter)",
        PARALLELISM,
        choices=("sharded", "replicated"),
    ),
    Setting(
        "fsdp_gather",
        str,
        "auto",
        "fsdp, hsdp: where the step gathers the split weights. xla: XLA places the gathers (fewest bytes; "
        "without --remat every layer's gathered weights are held from the forward to the backward); layer: each "
        "layer of the model's layer class gathers its weights just before it runs and again in the backward, as "
        "ZeRO-3 (about one layer's weights whole at a time; more gather traffic, slower); auto: xla where the "
        "step fits the devices' memory, else layer",
        PARALLELISM,
        choices=("auto", "layer", "xla"),
    ),
    Setting(
        "network_gbps",
        Optional[float],
        None,
        "jax, GPUs on several hosts: the network between hosts in Gbit/s (doctor --network measures it). XLA's "
        "scheduler is then told what each collective crossing it costs (its bytes at that rate), and starts "
        "them earlier, beside more compute; the step compiles twice the first time",
        PARALLELISM,
        check=ABOVE_ZERO,
        metavar="GBPS",
        default_help="not told: XLA assumes fast links",
    ),
    Setting(
        "model_parallel",
        int,
        0,
        "tensor: size of the model mesh axis",
        PARALLELISM,
        check=NON_NEGATIVE,
        default_help="the largest of 1-4 that divides",
    ),
    Setting(
        "devices", int, 8, "CPU devices to emulate per process without an accelerator", PARALLELISM, check=POSITIVE, decides_step=False
    ),
    # None: RAY_ADDRESS when set (as under `ray job submit`), else a local Ray.
    Setting(
        "address",
        Optional[str],
        None,
        "local | auto | HOST:PORT (the head's GCS) | none (no Ray)",
        CLUSTER,
        metavar="ADDR",
        default_help="RAY_ADDRESS, else local",
        decides_step=False,
    ),
    Setting(
        "processes", int, 0, "JAX processes, one per node", CLUSTER, check=NON_NEGATIVE, default_help="every alive node", decides_step=False
    ),
    Setting(
        "straggler_every",
        int,
        5,
        "several JAX processes: every N steps each times its own devices (a fixed "
        "probe) and input; a device or input 10 percent slower than the others' median over the last "
        "--straggler-window steps is named in the log, the progress line, the report and TensorBoard (0: off)",
        CLUSTER,
        check=NON_NEGATIVE,
        metavar="N",
        decides_step=False,
    ),
    Setting(
        "straggler_window",
        int,
        50,
        "several JAX processes: the steps a straggler is judged over (at least --straggler-every): nobody is "
        "named before a window is full, so slow steps want a shorter one",
        CLUSTER,
        check=POSITIVE,
        metavar="STEPS",
        decides_step=False,
    ),
    Setting("auto_trial_steps", int, 3, "auto: timed steps per candidate", PARALLELISM, check=POSITIVE, decides_step=False),
    Setting(
        "auto_rank_on",
        str,
        "copies",
        "auto: where candidates are timed: copies (a model that declares its "
        "depth_setting, as gpt does, of 6 layers or more: copies with 1 and 3 of its layers, the whole model's "
        "step time and memory predicted from them, only the winner compiled whole; of candidates predicted "
        "within 3 percent, the one needing the least memory; any other model is ranked whole) or whole (every "
        "candidate compiled and timed at full depth: a slower start, the exact ranking)",
        PARALLELISM,
        choices=("copies", "whole"),
        decides_step=False,
    ),
    Setting(
        "auto_compile_workers",
        int,
        0,
        "auto: candidates compiled at once (0: all; on GPUs the first always compiles alone)",
        PARALLELISM,
        check=NON_NEGATIVE,
        metavar="N",
        decides_step=False,
    ),
    Setting(
        "memory_limit_gb",
        Optional[float],
        None,
        "auto: per-device memory budget",
        PARALLELISM,
        metavar="GB",
        default_help="the device's own",
        decides_step=False,
    ),
    Setting(
        "cluster_spec",
        Optional[str],
        None,
        "cluster spec YAML (ports, CIDR)",
        CLUSTER,
        metavar="FILE",
        default_help="the package's, or ALPA_KIT_CLUSTER_SPEC",
        decides_step=False,
    ),
    Setting(
        "compile_cache",
        Optional[str],
        None,
        "jax: persistent compile cache, so a second identical run skips compiling; on a cluster a folder every node sees",
        PARALLELISM,
        metavar="DIR",
        default_help="~/.cache/alpa_job/jax; 'none' turns it off",
        decides_step=False,
    ),
    # Pipelines: the JAX engine's --strategy pipeline and Alpa's methods.
    Setting(
        "micro_batches",
        int,
        0,
        "jax pipeline: micro-batches a step's batch is cut into (the bubble is "
        "(stages - 1) / (micro-batches + stages - 1)); alpa: num_micro_batches",
        PARALLELISM,
        check=NON_NEGATIVE,
        default_help="jax pipeline: 4 per stage; alpa: 1",
    ),
    Setting(
        "pipeline_stages",
        int,
        0,
        "jax pipeline and alpa pipeshard-manual: stages",
        PARALLELISM,
        check=NON_NEGATIVE,
        default_help="one per node (jax: two on one node)",
    ),
    Setting(
        "pipeline_repeats",
        int,
        1,
        "jax pipeline: chunks of blocks each stage holds; above 1 the schedule is "
        "circular, micro-batches going round the stages that many times (bubble (stages - 1) / (repeats x "
        "micro-batches + stages - 1), at repeats x the hand-offs)",
        PARALLELISM,
        check=POSITIVE,
        default_help="1: GPipe",
    ),
    # Alpa engine only.
    Setting(
        "pipeline_layers",
        int,
        0,
        "alpa pipeshard-auto: AutoLayerOption layer_num",
        PARALLELISM,
        check=NON_NEGATIVE,
        default_help="the model's layers",
    ),
    Setting(
        "plan_cache",
        Optional[str],
        None,
        "alpa pipeshard-auto: folder to save/reuse the auto search result",
        PARALLELISM,
        metavar="DIR",
        decides_step=False,
    ),
)

OUTPUT_AND_RESTARTS = (
    Setting(
        "out",
        Optional[str],
        None,
        "run directory for report, train.log and checkpoints",
        OUTPUT,
        metavar="DIR",
        default_help="runs/<time>-<model>-<strategy>, runs/latest -> the newest",
        decides_step=False,
    ),
    # Written by the driver, the one writer (train/metrics_log.py); runs under one folder compare in one TensorBoard.
    Setting(
        "tensorboard",
        bool,
        True,
        "TensorBoard event files in OUT/tensorboard",
        OUTPUT,
        decides_step=False,
        switches=(
            Switch("--tensorboard", True, "write TensorBoard event files into OUT/tensorboard (default)"),
            Switch("--no-tensorboard", False, "write no TensorBoard event files"),
        ),
    ),
    Setting(
        "track",
        str,
        "none",
        "also log the metrics and settings to MLflow or W&B (offline unless configured; the package must be installed)",
        OUTPUT,
        choices=TRACKERS,
        decides_step=False,
    ),
    Setting(
        "checkpoint_every",
        int,
        0,
        "save an orbax checkpoint every N steps (a run stopped by SIGTERM also "
        "saves the step it stopped at, into OUT/checkpoints, without it)",
        OUTPUT,
        check=NON_NEGATIVE,
        default_help="none",
        decides_step=False,
    ),
    # auto: what a restarted job runs (a RayJob retry, a systemd unit) - the same command, first time or not.
    Setting(
        "resume",
        bool,
        False,
        "continue from the latest checkpoint in --out (same model settings); "
        "--resume auto: continue when --out holds a complete checkpoint, else start fresh",
        OUTPUT,
        words=("auto",),
        metavar="auto",
        decides_step=False,
    ),
    Setting(
        "init_from",
        Optional[str],
        None,
        "jax: start from a Hugging Face checkpoint's weights instead of random "
        "ones (hf:DIR, a folder of config.json and *.safetensors; the model's settings must give its shapes); "
        "with --resume a run's own checkpoint comes first",
        OUTPUT,
        metavar="hf:DIR",
        default_help="random weights",
        decides_step=False,
    ),
    Setting(
        "max_restarts",
        int,
        0,
        "jax engine on Ray: after a lost process or node, restart up to N times on the nodes alive then, from the last checkpoint",
        OUTPUT,
        check=NON_NEGATIVE,
        default_help="0, fail fast",
        decides_step=False,
    ),
    Setting(
        "restart_wait",
        float,
        0.0,
        "seconds a restart waits for a replacement node to join",
        OUTPUT,
        check=NON_NEGATIVE,
        metavar="S",
        default_help="0, go on with the survivors",
        decides_step=False,
    ),
    # The watchdog (launch/worker_group.py): alive but silent is a loss too, named and torn down.
    Setting(
        "profile",
        Optional[str],
        None,
        "jax engine: a JAX profiler trace of steps START..START+COUNT-1 in "
        "OUT/profile (TensorBoard/XProf, Perfetto), and their communication share in the report",
        OUTPUT,
        metavar="START:COUNT",
        decides_step=False,
    ),
    Setting(
        "hang_timeout",
        float,
        300.0,
        "jax engine on Ray: a process whose step has not advanced for S seconds "
        "is named as hung and the job torn down (restarted with --max-restarts); before its first step "
        "(start, compile, restore) it has 3 x S; 0 turns the watchdog off",
        OUTPUT,
        check=NON_NEGATIVE,
        metavar="S",
        default_help="300",
        decides_step=False,
    ),
    # Without it an --out holding another run's checkpoints is refused rather than mixed.
    Setting("overwrite", bool, False, "replace the checkpoints and reports of an earlier run in --out", OUTPUT, decides_step=False),
)


# A model's own settings as one mapping (not a field per setting): the builder's declaration names and
# types them. A built-in's are its size flags too.
MODEL_ARGS = Setting(
    "model_args",
    ModelArgs,
    ModelArgs(),
    "a setting of the model's builder, e.g. num_layers=4 (repeatable; YAML: model_args:)",
    cli_flag="--model-arg",
    metavar="KEY=VALUE",
    default_help="the builder's defaults",
)


SETTINGS: Tuple[Setting, ...] = WHAT_TO_TRAIN + (MODEL_ARGS,) + HOW_TO_RUN + OUTPUT_AND_RESTARTS
BY_NAME: Dict[str, Setting] = {s.name: s for s in SETTINGS}
if len(BY_NAME) != len(SETTINGS):  # a programming error: two declarations of one name
    raise ValueError(
        "settings declared twice: " + ", ".join(sorted({s.name for s in SETTINGS if sum(t.name == s.name for t in SETTINGS) > 1}))
    )
FIELD_NAMES: Tuple[str, ...] = tuple(BY_NAME)


# The settings that cannot change the compiled train step (the step store leaves them out of its key).
NOT_IN_STEP: Tuple[str, ...] = tuple(s.name for s in SETTINGS if not s.decides_step)


def setting(name: str) -> Setting:
    return BY_NAME[name]


def in_group(group: str) -> Tuple[Setting, ...]:
    """The settings `--help` shows under `group`, in catalogue order."""
    return tuple(s for s in SETTINGS if s.group == group)
