"""`python -m alpa_job [train|inspect|doctor|cluster] ...`: argument parsing and dispatch only.

No arguments = `train` with the defaults: the tutorial MLP on the embedded default (a local Ray
and emulated CPU devices), or on the cluster when run under `ray job submit`.
"""
from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import List, Optional

from alpa_job.errors import EXIT_OK, KitError

SUBCOMMANDS = ("train", "inspect", "doctor", "cluster")


def _train_parser(sub) -> None:
    p = sub.add_parser("train", help="train a model and write a report (the default command)")
    p.add_argument("--preset", help="named settings from alpa_job/presets (gpt-24l, mlp-tutorial, ...); "
                                    "--config and flags override it")
    p.add_argument("--config", help="YAML file of job settings; flags override it")
    p.add_argument("--model", help="mlp | wide_resnet | gpt")
    p.add_argument("--dataset", help="synthetic | cifar10")
    p.add_argument("--data-dir", help="cifar10: folder with data_batch_1..5")
    p.add_argument("--num-samples", type=int, help="synthetic dataset size")
    p.add_argument("--batch-size", type=int, help="global batch size")
    p.add_argument("--epochs", type=int)
    p.add_argument("--steps", type=int, help="stop after this many steps")
    p.add_argument("--learning-rate", type=float)
    ragged = p.add_mutually_exclusive_group()
    ragged.add_argument("--drop-remainder", dest="remainder", action="store_const", const="drop",
                        help="drop a ragged last batch (default)")
    ragged.add_argument("--pad-remainder", dest="remainder", action="store_const", const="pad",
                        help="pad a ragged last batch and mask it out of the loss")
    p.add_argument("--engine", help="auto | jax | alpa (auto: alpa when it imports, else jax)")
    p.add_argument("--strategy", help="jax: data | fsdp | tensor | auto; alpa: data | shard | pipeshard-manual | "
                                      "pipeshard-auto")
    p.add_argument("--model-parallel", type=int, help="tensor: size of the model mesh axis")
    p.add_argument("--devices", type=int, help="CPU devices to emulate per process without an accelerator")
    p.add_argument("--processes", type=int, help="JAX processes, one per node (default: every alive node)")
    p.add_argument("--dtype", help="float32 | bfloat16")
    p.add_argument("--address", help="local | auto | HOST:PORT | none (default: RAY_ADDRESS, else local)")
    p.add_argument("--cluster-spec", help="cluster spec YAML (ports, CIDR); default: the package's")
    p.add_argument("--out", help="run directory for report and checkpoints (default runs/latest)")
    p.add_argument("--seed", type=int)
    p.add_argument("--checkpoint-every", type=int, help="save an orbax checkpoint every N steps")
    p.add_argument("--resume", action="store_const", const=True, help="continue from the latest checkpoint in --out")
    p.add_argument("--max-restarts", type=int, help="jax on Ray: after a lost process/node, restart this many times on "
                                                    "the surviving nodes from the last checkpoint (default 0: fail fast)")
    p.add_argument("--restart-wait", type=float, help="seconds a restart waits for a replacement node to join (default 0)")
    p.add_argument("--auto-trial-steps", type=int, help="auto: timed steps per candidate")
    p.add_argument("--memory-limit-gb", type=float, help="auto: per-device memory budget")
    p.add_argument("--micro-batches", type=int, help="alpa: num_micro_batches")
    p.add_argument("--pipeline-stages", type=int, help="alpa pipeshard-manual: stages (default: one per node)")
    p.add_argument("--pipeline-layers", type=int, help="alpa pipeshard-auto: AutoLayerOption layer_num")
    p.add_argument("--plan-cache", help="alpa pipeshard-auto: folder to save/reuse the auto search result")
    for name in ("hidden-dim", "depth", "width", "num-layers", "d-model", "num-heads", "seq-len", "vocab-size"):
        p.add_argument(f"--{name}", type=int)


def _inspect_parser(sub) -> None:
    p = sub.add_parser("inspect", help="re-render the report of a run directory or an Alpa dump folder")
    p.add_argument("path", help="a run directory (report.json) or an Alpa dump_debug_info folder")
    p.add_argument("--format", default="table", choices=("table", "json", "md", "html"))
    p.add_argument("--output", help="html/md: file to write (default: PATH/report.html or stdout for md)")


def _doctor_parser(sub) -> None:
    p = sub.add_parser("doctor", help="check a running cluster: IPs, ports, tasks, versions")
    p.add_argument("--address", help="Ray address (default: RAY_ADDRESS, else auto)")
    p.add_argument("--cluster-spec", help="cluster spec YAML (ports, CIDR)")
    p.add_argument("--format", default="table", choices=("table", "json"))
    p.add_argument("--deadline", type=float, default=60.0, help="overall seconds before giving up")
    p.add_argument("--node-timeout", type=float, default=10.0,
                   help="seconds a probe pinned to one node may take before that node fails")
    p.add_argument("--skip-ports", help="comma-separated planned port names not to probe (Kubernetes: ssh)")


def _cluster_parser(sub) -> None:
    from alpa_job.ops.cli import add_parser  # up|down|status|logs|preflight: alpa_job/ops

    add_parser(sub)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m alpa_job", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command")
    _train_parser(sub)
    _inspect_parser(sub)
    _doctor_parser(sub)
    _cluster_parser(sub)
    return parser


def main(argv: Optional[List[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in SUBCOMMANDS + ("-h", "--help"):
        argv = ["train"] + argv  # bare flags mean train
    args = build_parser().parse_args(argv)
    try:
        if args.command == "inspect":
            return _inspect(args)
        if args.command == "doctor":
            from alpa_job.cluster import doctor

            return doctor.main(args)
        if args.command == "cluster":
            from alpa_job.ops import cli as ops_cli

            return ops_cli.main(args)
        return _train(args)
    except KitError as err:
        print(f"error: {err}", file=sys.stderr)
        logging.getLogger(__name__).debug("user error", exc_info=True)
        return err.exit_code


def _train(args) -> int:
    from alpa_job import config as config_lib
    from alpa_job.runner import run_job

    file_values = config_lib.load_settings(args.preset, args.config)
    cli_values = {k: v for k, v in vars(args).items() if k in config_lib.FIELD_NAMES}
    config = config_lib.build_config(file_values, cli_values)
    record, paths = run_job(config)
    s = record.summary
    print(f"trained {config.model} with {record.engine}/{record.strategy} on {s.devices} devices "
          f"({s.processes} process(es), {s.hosts} host(s)): {record.steps} steps, "
          f"{record.compiles} compile, loss {s.loss_first} -> {s.loss_last}")
    print(f"report: {paths['html']}  (also {os.path.basename(paths['json'])}, {os.path.basename(paths['md'])})")
    return EXIT_OK


def _inspect(args) -> int:
    from alpa_job.inspect import render
    from alpa_job.inspect.load import load_any
    from alpa_job.report import report_json

    record = load_any(args.path)
    if args.format == "json":
        print(report_json(record))
    elif args.format == "table":
        print(render.to_table(record))
    elif args.format == "md":
        text = render.to_markdown(record)
        if args.output:
            _write(args.output, text)
        else:
            print(text)
    else:
        target = args.output or os.path.join(args.path if os.path.isdir(args.path) else os.path.dirname(args.path),
                                             "report.html")
        _write(target, render.to_html(record))
        print(target)
    return EXIT_OK


def _write(path: str, text: str) -> None:
    try:
        with open(path, "w") as f:
            f.write(text)
    except OSError as err:
        raise KitError(f"cannot write {path} ({err.strerror}); pass --output to a writable file") from None
