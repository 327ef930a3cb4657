"""`python -m alpa_job plan`: its flags and what it prints and writes."""

from __future__ import annotations

import argparse
import json
import os

from alpa_job import strategies as strategy_records
from alpa_job.errors import EXIT_OK, KitError
from alpa_job.planner.settings_read import COST_MODELS, MODEL_SETTINGS

EPILOG = """examples:
  python -m alpa_job plan --preset gpt-24l --nodes 4 --gpus-per-node 8 --gpu h100
  python -m alpa_job plan --preset gpt-small --nodes 2 --gpus-per-node 4 --batch-size 64 --out plans/small
  python -m alpa_job plan --preset gpt-12l --nodes 2 --gpus-per-node 8 --gpu l40s --gpu-memory-gb 48 \\
      --gpu-tflops 362 --nvlink-gbps 32 --network-gbps 200

  python -m alpa_job plan --preset gpt-24l --nodes 2 --gpus-per-node 8 --gpu-profile plans/gpu-profile-nvidia-h100.json

`python -m alpa_job plan calibrate [--out FILE]`, on one machine with the GPU you plan for, measures its matmul
rate by shape, HBM bandwidth, launch overhead (and collectives, with several GPUs) into the profile that
--gpu-profile reads (python -m alpa_job plan calibrate --help).

Nothing is trained and no GPU is needed: each candidate's train step is compiled for NODES x GPUS emulated
CPU devices. Writes OUT/plan.json (schema: alpa_job/record/plan.schema.json) and OUT/plan.html.
"""


def add_parser(sub, add_setting) -> None:
    """The `plan` parser under `sub`; `add_setting(group, setting)` adds a catalogue setting's flags the way
    `train` has them."""
    from alpa_job.models import size_settings
    from alpa_job.settings import catalog

    p = sub.add_parser(
        "plan",
        help="plan a cluster you don't have: memory, traffic and step time per strategy",
        description="Compile every strategy x mesh for N nodes x G GPUs on emulated CPU devices and "
        "estimate memory, NVLink/network bytes and step time on the GPUs.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    g = p.add_argument_group("model (as for train)")
    g.add_argument("--preset", metavar="NAME", help="named settings from alpa_job/settings/presets (gpt-24l, ...)")
    g.add_argument("--config", metavar="FILE", help="YAML file of job settings; flags override it")
    for setting in catalog.SETTINGS:
        if setting.name in MODEL_SETTINGS:
            add_setting(g, setting)
        if setting is catalog.MODEL_ARGS:  # the built-ins' sizes, as train has them
            for size in size_settings():
                add_setting(g, size)
    c = p.add_argument_group("cluster")
    c.add_argument("--nodes", type=int, required=True, metavar="N", help="nodes")
    c.add_argument("--gpus-per-node", type=int, required=True, metavar="G", help="GPUs per node")
    c.add_argument(
        "--gpu",
        metavar="NAME",
        help="h100, h200 or a100, or any name with "
        "--gpu-memory-gb, --gpu-tflops and --nvlink-gbps (default: h100, or the --gpu-profile's GPU)",
    )
    c.add_argument(
        "--gpu-profile",
        metavar="FILE",
        help="a GPU profile written by python -m alpa_job plan "
        "calibrate: its measured bf16 matmul rate (and, measured on several GPUs, all-reduce bandwidth) "
        "replace the catalogue's",
    )
    c.add_argument("--gpu-memory-gb", type=float, metavar="GB", help="memory of one GPU")
    c.add_argument("--gpu-tflops", type=float, metavar="T", help="dense bf16 peak of one GPU, TFLOP/s")
    c.add_argument("--nvlink-gbps", type=float, metavar="GB/S", help="NVLink bandwidth of one GPU, one direction, GB/s")
    c.add_argument(
        "--network-gbps",
        type=float,
        default=None,
        metavar="Gb/S",
        help="network bandwidth per GPU across nodes, one direction, Gbit/s (default: 400, one NDR NIC a GPU)",
    )
    c.add_argument(
        "--network-from",
        metavar="FILE",
        help="the network figure measured on your cluster: the JSON of "
        "python -m alpa_job doctor --network --format json (its median link, shared by a node's GPUs)",
    )
    o = p.add_argument_group("plan")
    o.add_argument(
        "--strategy",
        default="all",
        type=_strategy_list,
        metavar="all|NAME[,NAME...]",
        help="which strategies to plan (default: all); a pipeline named here is planned on one node too "
        f"(two stages), which `all` leaves out. Names: {', '.join(strategy_records.STRATEGIES)}",
    )
    o.add_argument("--model-parallel", type=int, default=0, metavar="M", help="tensor: only this model axis size")
    o.add_argument(
        "--cost-model",
        default="auto",
        choices=COST_MODELS,
        help="kernels: compile each candidate for the GPU and cost its kernels one by one (needs JAX's CUDA "
        "plugin, no GPU); flops: compile for CPU devices and cost the step's FLOPs and traffic; auto (default): "
        "kernels where it can run, flops where a candidate pipelines across nodes (slow to compile for the GPU)",
    )
    o.add_argument("--out", metavar="DIR", default="plans/latest", help="where plan.json and plan.html go (default: plans/latest)")
    o.add_argument("--timeout", type=float, default=1800.0, metavar="S", help="seconds the compiling may take in all (default: 1800)")


def _strategy_list(text: str):
    """`all`, or strategy names separated by commas (argparse turns the error into one line, exit 2)."""
    if text == "all":
        return None  # every strategy auto would try
    names = tuple(dict.fromkeys(name.strip() for name in text.split(",") if name.strip()))
    unknown = [name for name in names if name not in strategy_records.STRATEGIES]
    if unknown or not names:
        raise argparse.ArgumentTypeError(
            f"unknown strategy {', '.join(map(repr, unknown)) or repr(text)}; use all, or names separated by commas "
            f"from: {', '.join(strategy_records.STRATEGIES)}"
        )
    return names


def _network(args):
    """(Gb/s per GPU, where it came from or None): typed, measured by the doctor, or the default."""
    if args.network_from and args.network_gbps is not None:
        raise KitError("--network-gbps and --network-from both set the network figure; keep one")
    if args.network_from:
        from alpa_job.planner.network_from import network_gbps_from

        return network_gbps_from(args.network_from, max(1, args.gpus_per_node))
    return (400.0 if args.network_gbps is None else args.network_gbps), None


def run(args) -> int:
    from alpa_job.models import size_settings
    from alpa_job.progress.display import DEFAULT
    from alpa_job.progress.events import configure
    from alpa_job.planner import gpus, render
    from alpa_job.planner.plan import make_plan
    from alpa_job.planner.plan import model_values
    from alpa_job.settings import config as config_lib

    configure(DEFAULT)
    gpu = gpus.resolve(args.gpu, args.gpu_memory_gb, args.gpu_tflops, args.nvlink_gbps, profile_path=args.gpu_profile)
    if args.model_parallel < 0 or args.timeout <= 0:
        raise KitError("--model-parallel must be >= 0 and --timeout > 0")
    sizes = {s.name: getattr(args, s.name, None) for s in size_settings()}
    cli_values = {
        **model_values({k: v for k, v in vars(args).items() if k in config_lib.FIELD_NAMES}),
        **{k: v for k, v in sizes.items() if v is not None},
    }
    strategies = args.strategy
    network_gbps, network_source = _network(args)
    record = make_plan(
        args.preset,
        args.config,
        cli_values,
        args.nodes,
        args.gpus_per_node,
        gpu,
        network_gbps,
        strategies,
        args.model_parallel,
        args.timeout,
        network_source=network_source,
        cost_model=args.cost_model,
    )
    try:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "plan.json"), "w") as f:
            json.dump(record.to_dict(), f, indent=1)
        with open(os.path.join(args.out, "plan.html"), "w") as f:
            f.write(render.to_html(record))
    except OSError as err:
        raise KitError(f"cannot write the plan to {args.out} ({err.strerror}); pass --out a writable folder") from None
    print(render.to_table(record), flush=True)
    print(f"plan: {os.path.join(args.out, 'plan.html')}  (also plan.json)", flush=True)
    return EXIT_OK
