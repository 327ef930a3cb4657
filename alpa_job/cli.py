"""`python -m alpa_job [train|inspect|doctor|cluster|data|plan] ...`: argument parsing and dispatch only.

No arguments = `train` with the defaults: the tutorial MLP on the embedded default (a local Ray
and emulated CPU devices), or on the cluster when run under `ray job submit`.
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import sys
from typing import List, Optional

from alpa_job.choices import did_you_mean
from alpa_job.errors import EXIT_OK, EXIT_PREEMPTED, KitError
from alpa_job.models import BUILT_IN, size_names, size_settings
from alpa_job.setting import GROUPS, OUTPUT, ModelArgs, Setting, plain_type

SUBCOMMANDS = ("train", "inspect", "doctor", "cluster", "data", "plan", "hf")


EXIT_CODES = (
    "exit codes: 0 done; 1 training failed or diverged (the report in the run directory says how far it "
    "got); 2 bad input (one line: what to change); 3 a check found the cluster unhealthy; "
    "4 a network wait ran past its deadline (--address, node start); "
    "75 preempted: SIGTERM stopped the run at a step saved as a checkpoint (rerun with --resume auto)"
)

TRAIN_EPILOG = (
    """examples:
  python -m alpa_job train                                    # the tutorial MLP on a local Ray, 8 CPU devices
  python -m alpa_job train --preset gpt-small --strategy auto # try data/fsdp/tensor, keep the fastest
  python -m alpa_job train --model gpt --strategy tensor --model-parallel 2 --steps 50 --out runs/gpt-tp2
  python -m alpa_job train --address 10.0.0.1:6379 --checkpoint-every 100 --out runs/long --resume
  python -m alpa_job train --model my_models.llama:build --model-arg num_layers=4 --strategy fsdp  # your model

runs go to runs/<time>-<model>-<strategy>/ (runs/latest points at the newest): report.html/.md/.json,
train.log, checkpoints/. Compare runs: python -m alpa_job inspect --compare runs/A runs/B

"""
    + EXIT_CODES
)


def _train_parser(sub) -> None:
    from alpa_job.settings import catalog

    p = sub.add_parser(
        "train",
        help="train a model and write a report (the default command)",
        description="Train a model with a parallel strategy and write a report of its plan.",
        epilog=TRAIN_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    g = p.add_argument_group("settings files")
    g.add_argument(
        "--preset",
        metavar="NAME",
        help="named settings from alpa_job/settings/presets (gpt-24l, mlp-tutorial, ...); --config and flags override it",
    )
    g.add_argument("--config", metavar="FILE", help="YAML file of job settings (keys as the flags, - or _); flags override it")
    groups = {name: p.add_argument_group(name) for name in GROUPS}
    for setting in catalog.SETTINGS:
        _add_setting(groups[setting.group], setting)
        if setting is catalog.MODEL_ARGS:  # the built-ins' sizes, each a flag of its own: a --model-arg spelled out
            for size in size_settings():
                _add_setting(groups[size.group], size)
    # How the run talks to the terminal: not job settings (the report's config does not keep them).
    g = groups[OUTPUT]
    g.add_argument(
        "--progress-every",
        type=int,
        metavar="N",
        default=0,
        help="without a terminal: a progress line every N steps (default: about 10 per run)",
    )
    _verbosity_flags(g)


def _add_setting(group, setting: Setting) -> None:
    """One catalogue setting as flags: `--name VALUE` (converted with its type), `--name` for a bool,
    or its switches, one value each. Every value stays None unless given, so the files' layers and the
    defaults show through."""
    if setting.switches:
        exclusive = group.add_mutually_exclusive_group()
        for switch in setting.switches:
            exclusive.add_argument(switch.flag, dest=setting.name, action="store_const", const=switch.value, help=switch.help)
        return
    kind = plain_type(setting.type)
    text = (f"{setting.model}: " if setting.model else "") + setting.help
    if setting.name == "model":
        text = text.replace("a built-in", ", ".join(BUILT_IN)) + _installed_models_text()
    if kind is ModelArgs:  # repeatable KEY=VALUE; the model's declaration types the values
        group.add_argument(setting.flag, dest=setting.name, action="append", metavar=setting.metavar, help=text + _default_text(setting))
        return
    if kind is bool and setting.words:  # `--resume` alone is True; `--resume auto` the word
        group.add_argument(setting.flag, dest=setting.name, nargs="?", const=True, metavar=setting.metavar, help=text)
        return
    if kind is bool:
        group.add_argument(setting.flag, dest=setting.name, action="store_const", const=True, help=text)
        return
    group.add_argument(
        setting.flag,
        dest=setting.name,
        type=None if kind is str else kind,
        metavar=_metavar(setting, kind),
        help=text + _default_text(setting),
    )


def _installed_models_text() -> str:
    """The models installed packages expose (entry points: metadata only, nothing imported)."""
    from alpa_job.models.installed import installed_models

    names = list(installed_models())
    return f"; installed: {', '.join(names)}" if names else ""


def _metavar(setting: Setting, kind: type) -> Optional[str]:
    """{a,b,c} for a choice (the value is checked by JobConfig, whose error suggests the nearest name)."""
    if setting.choices is not None:
        return "{" + ",".join(setting.choices) + "}"
    return setting.metavar or ("N" if kind is int else None)


def _default_text(setting: Setting) -> str:
    """' (default: X)' from the catalogue, so --help never disagrees with the code."""
    if setting.default_help is not None:
        return f" (default: {setting.default_help})"
    return "" if setting.default is None else f" (default: {setting.default})"


def _verbosity_flags(g) -> None:
    loud = g.add_mutually_exclusive_group()
    loud.add_argument("-v", "--verbose", action="store_true", help="also Ray's own output (worker logs, C++ warnings, notices)")
    loud.add_argument("-q", "--quiet", action="store_true", help="only the result line and errors")


def _inspect_parser(sub) -> None:
    p = sub.add_parser(
        "inspect",
        help="re-render the report of a run directory or an Alpa dump folder, or compare runs",
        epilog="examples:\n  python -m alpa_job inspect runs/latest\n"
        "  python -m alpa_job inspect runs/latest --format html\n"
        "  python -m alpa_job inspect --compare runs/A runs/B runs/C --format html\n\n" + EXIT_CODES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("path", nargs="?", help="a run directory (report.json) or an Alpa dump_debug_info folder")
    p.add_argument(
        "--compare",
        nargs="+",
        metavar="RUN",
        help="two or more run directories: one table and plots of step time, throughput, bytes, collectives",
    )
    p.add_argument(
        "--format", default="table", choices=("table", "json", "md", "html"), help="table (terminal), json, md or html (default: table)"
    )
    p.add_argument(
        "--output", metavar="FILE", help="html/md: file to write (default: PATH/report.html, compare.html for --compare, stdout for md)"
    )
    p.add_argument(
        "--all-rows",
        action="store_true",
        help="table: every parameter/state leaf (default: at most 60 rows, leaves grouped across layers and experts)",
    )


def _doctor_parser(sub) -> None:
    p = sub.add_parser("doctor", help="check a running cluster: IPs, ports, tasks, versions")
    p.add_argument("--address", help="Ray address (default: RAY_ADDRESS, else auto)")
    p.add_argument("--cluster-spec", help="cluster spec YAML (ports, CIDR)")
    p.add_argument("--format", default="table", choices=("table", "json"), help="table or json (default: table)")
    p.add_argument("--deadline", type=float, default=60.0, help="overall seconds before giving up (default: 60)")
    p.add_argument(
        "--node-timeout", type=float, default=10.0, help="seconds a probe pinned to one node may take before that node fails (default: 10)"
    )
    p.add_argument("--skip-ports", help="comma-separated planned port names not to probe (Kubernetes: ssh)")
    p.add_argument(
        "--network",
        action="store_true",
        help="also measure every link between the nodes, both ways "
        "(Gb/s, round trip) on the ephemeral range training traffic uses, and name slow hosts or links",
    )
    p.add_argument(
        "--nccl-log",
        nargs="+",
        metavar="FILE",
        help="read NCCL's INFO logs (files, or run/log directories) instead of probing the cluster: "
        "which transports NCCL chose and what is wrong with them (exit 3 on a problem)",
    )
    p.add_argument(
        "--fabric",
        choices=("ib", "roce", "ethernet"),
        help="with --nccl-log: the network NCCL should use (default: the cluster spec's network.fabric, else ethernet)",
    )


def _cluster_parser(sub) -> None:
    from alpa_job.cluster.control.cli import add_parser  # up|down|status|logs|preflight: alpa_job/cluster/control

    add_parser(sub)


DATA_EPILOG = (
    """examples:
  python -m alpa_job data tokenize corpus/ --out data/train.bin                      # bytes: ids 0..255, eot 256
  python -m alpa_job data tokenize 'books/*.txt' --out data/train.bin --tokenizer tiktoken:gpt2
  python -m alpa_job data tokenize a.txt b.txt --out data/train.bin --tokenizer gpt2.tiktoken

the file: raw little-endian token ids (uint16, or uint32 for vocabularies over 65,536), no header,
each input one document followed by the end-of-text id; FILE.bin.json beside it says what made it.
Train on it with --dataset tokens --data-path FILE.bin.

"""
    + EXIT_CODES
)


def _data_parser(sub) -> None:
    p = sub.add_parser("data", help="prepare a dataset: tokenize text files into a flat token file")
    verbs = p.add_subparsers(dest="data_command", metavar="ACTION")
    verbs.required = True
    q = verbs.add_parser(
        "tokenize",
        help="text files -> one binary file of token ids (--dataset tokens)",
        description="Tokenize UTF-8 text files into one flat binary token file, offline.",
        epilog=DATA_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    q.add_argument(
        "inputs", nargs="+", metavar="INPUT", help="text files, folders (their *.txt, sorted) or quoted globs; each file is one document"
    )
    q.add_argument("--out", required=True, metavar="FILE.bin", help="the token file to write (FILE.bin.json beside it)")
    q.add_argument(
        "--tokenizer",
        default="bytes",
        metavar="NAME",
        help="bytes (UTF-8 bytes, vocab 257), tiktoken:NAME from tiktoken's cache (tiktoken:gpt2; "
        "never downloaded: TIKTOKEN_CACHE_DIR), or PATH.tiktoken, a local BPE ranks file "
        "(default: bytes)",
    )
    q.add_argument("--token-dtype", choices=("uint16", "uint32"), help="id width (default: uint16 when the vocabulary fits, else uint32)")
    q.add_argument("--no-eot", action="store_true", help="no end-of-text id after each document")


def _hf_parser(sub) -> None:
    p = sub.add_parser("hf", help="Hugging Face checkpoints: write a run's weights as one, or the logits of one")
    verbs = p.add_subparsers(dest="hf_command", metavar="ACTION")
    verbs.required = True
    e = verbs.add_parser(
        "export", help="a run's checkpoint -> a Hugging Face checkpoint folder (config.json + *.safetensors) of its model's architecture"
    )
    e.add_argument("run", metavar="RUN", help="the run folder (train's --out)")
    e.add_argument("dir", metavar="DIR", help="the folder to write (new or empty)")
    e.add_argument("--step", type=int, help="the checkpoint step to export (default: the newest complete one)")
    e.add_argument(
        "--dtype",
        choices=("bfloat16", "float32", "float16"),
        default="bfloat16",
        help="the tensors' dtype (default: bfloat16, as published checkpoints)",
    )
    lg = verbs.add_parser(
        "logits",
        help="the kit's float32 logits for given token ids from a checkpoint folder, "
        "to compare its reading of the weights with your own reference",
    )
    lg.add_argument("dir", metavar="DIR", help="a Hugging Face checkpoint folder")
    lg.add_argument("--tokens", required=True, metavar="FILE.npy", help="integer token ids, [seq] or [batch, seq]")
    lg.add_argument("--out", required=True, metavar="FILE.npy", help="where to save the logits [.., seq, vocab]")
    lg.add_argument(
        "--model",
        default="llama",
        help="the model that reads the checkpoint (default: llama, the installed LLaMA example); its settings come from config.json",
    )
    lg.add_argument(
        "--model-arg",
        action="append",
        metavar="NAME=VALUE",
        help="a model setting config.json does not give (e.g. attention=einsum); repeatable",
    )


def _plan_parser(sub) -> None:
    from alpa_job.planner.cli import add_parser  # flags and output: alpa_job/planner/cli.py

    add_parser(sub, _add_setting)


def build_parser() -> argparse.ArgumentParser:
    parser = KitArgumentParser(prog="python -m alpa_job", description=__doc__.splitlines()[0], epilog=EXIT_CODES)
    sub = parser.add_subparsers(dest="command")
    _train_parser(sub)
    _inspect_parser(sub)
    _doctor_parser(sub)
    _cluster_parser(sub)
    _data_parser(sub)
    _plan_parser(sub)
    _hf_parser(sub)
    return parser


class KitArgumentParser(argparse.ArgumentParser):
    """argparse whose mistakes are the kit's one-line errors (exit 2), with the nearest flag suggested."""

    known_options: List[str] = []

    def error(self, message: str):  # noqa: D401 - argparse's hook
        hint = ""
        match = re.search(r"unrecognized arguments: (\S+)", message)
        if match:
            hint = did_you_mean(match.group(1).split("=")[0], KitArgumentParser.known_options)
        choice = re.search(r"invalid choice: '([^']*)' \(choose from (.*)\)", message)
        if choice:
            hint = did_you_mean(choice.group(1), [c.strip(" '") for c in choice.group(2).split(",")])
        raise KitError(f"{message}{hint}; see {self.prog} --help")


def _all_options(parser: argparse.ArgumentParser) -> List[str]:
    names: List[str] = []
    for action in parser._actions:  # argparse keeps no public list of a parser's options
        names += [o for o in action.option_strings if o.startswith("--")]
        if isinstance(action, argparse._SubParsersAction):
            for child in action.choices.values():
                names += _all_options(child)
    return sorted(set(names))


def _calibrate(argv: List[str]) -> int:
    """`python -m alpa_job plan calibrate ...`: measure this machine's accelerator for the planner."""
    from alpa_job.planner import measure_gpu

    parser = measure_gpu.build_parser(KitArgumentParser)
    KitArgumentParser.known_options = _all_options(parser)
    return measure_gpu.run(parser.parse_args(list(argv[2:])), argv)


def _command_argv(argv: List[str]) -> List[str]:
    """Bare flags mean `train`; a first word that is no command is an error naming the nearest one."""
    if not argv or argv[0].startswith("-") and argv[0] not in ("-h", "--help"):
        return ["train"] + argv
    if argv[0] not in SUBCOMMANDS + ("-h", "--help"):
        raise KitError(
            f"unknown command {argv[0]!r}{did_you_mean(argv[0], SUBCOMMANDS)}; "
            f"use one of: {', '.join(SUBCOMMANDS)} (python -m alpa_job --help)"
        )
    return argv


def main(argv: Optional[List[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        if argv[:2] == ["plan", "calibrate"]:  # plan's measuring mode: its own flags (no --nodes)
            return _calibrate(argv)
        parser = build_parser()
        KitArgumentParser.known_options = _all_options(parser)
        args = parser.parse_args(_command_argv(argv))
        if args.command == "inspect":
            return _inspect(args)
        if args.command == "doctor":
            from alpa_job.cluster.doctor import cli as doctor_cli

            return doctor_cli.main(args)
        if args.command == "cluster":
            from alpa_job.cluster.control import cli as control_cli

            return control_cli.main(args)
        if args.command == "data":
            from alpa_job.data import cli as data_cli

            return data_cli.run(args)
        if args.command == "plan":
            from alpa_job.planner import cli as plan_cli

            return plan_cli.run(args)
        if args.command == "hf":
            from alpa_job import hf_commands

            return hf_commands.run(args)
        return _train(args)
    except KitError as err:
        print(f"error: {err}", file=sys.stderr, flush=True)
        logging.getLogger(__name__).debug("user error", exc_info=True)
        return err.exit_code
    except KeyboardInterrupt:
        print("error: interrupted (the run directory keeps a report of the steps done)", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `inspect ... | head`: the reader left; not an error of ours
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_OK


def _train(args) -> int:
    from alpa_job.progress.display import DEFAULT, QUIET, VERBOSE
    from alpa_job.progress.events import configure
    from alpa_job.settings import config as config_lib
    from alpa_job.launch.runner import run_job

    verbosity = VERBOSE if args.verbose else QUIET if args.quiet else DEFAULT
    configure(verbosity, every=args.progress_every)
    if args.progress_every < 0:
        raise KitError(f"--progress-every must be >= 0, got {args.progress_every}")
    sizes = size_names()
    layers = config_lib.load_layers(args.preset, args.config, model_keys=sizes)
    cli_values = {k: v for k, v in vars(args).items() if k in config_lib.FIELD_NAMES}
    model_flags = {k: v for k, v in vars(args).items() if k in sizes}
    config = config_lib.build_config(config_lib.merge_layers(layers), cli_values, model_flags)
    explicit = [k for k, v in cli_values.items() if v is not None]
    explicit += list(layers[1])  # what the user's --config chain sets (a --preset's defaults are not)
    record, paths = run_job(config, explicit=explicit, capture_native=True)
    if record.status == "preempted":
        print(f"{record.error}; report: {paths['html']}", file=sys.stderr, flush=True)
        return EXIT_PREEMPTED
    s = record.summary
    print(
        f"trained {config.model} with {record.engine}/{record.strategy} on {s.devices} devices "
        f"({s.processes} process(es), {s.hosts} host(s)): {record.steps} steps, "
        f"{record.compiles} compile, loss {s.loss_first} -> {s.loss_last}",
        flush=True,
    )
    print(f"report: {paths['html']}  (also {os.path.basename(paths['json'])}, {os.path.basename(paths['md'])})", flush=True)
    return EXIT_OK


def _inspect(args) -> int:
    from alpa_job.inspect import render
    from alpa_job.inspect.load import load_any
    from alpa_job.record.report_file import report_json

    if args.compare:
        return _compare(([args.path] if args.path else []) + args.compare, args)
    if not args.path:
        raise KitError("inspect needs a run directory, an Alpa dump folder, or --compare RUN RUN")
    record = load_any(args.path)
    here = args.path if os.path.isdir(args.path) else os.path.dirname(args.path)
    return _emit(
        args,
        {
            "json": lambda: report_json(record),
            "table": lambda: render.to_table(record, all_rows=args.all_rows),
            "md": lambda: render.to_markdown(record),
            "html": lambda: render.to_html(record),
        },
        html_target=os.path.join(here, "report.html"),
    )


def _compare(paths: List[str], args) -> int:
    from alpa_job.inspect import compare

    data = compare.rows(paths)
    return _emit(
        args,
        {
            "json": lambda: compare.to_json(data),
            "table": lambda: compare.to_text(data),
            "md": lambda: compare.to_markdown(data),
            "html": lambda: compare.to_html(data),
        },
        html_target="compare.html",
        beside_html=lambda: compare.to_text(data),
    )


def _emit(args, render_as, html_target: str, beside_html=None) -> int:
    """One way out for `inspect` and `inspect --compare`: json and table print; md prints, or writes
    --output; html writes --output (default `html_target`) and prints its path (after `beside_html()`)."""
    if args.format in ("json", "table"):
        print(render_as[args.format]())
    elif args.format == "md":
        text = render_as["md"]()
        if args.output:
            _write(args.output, text)
        else:
            print(text)
    else:
        target = args.output or html_target
        _write(target, render_as["html"]())
        if beside_html is not None:
            print(beside_html())
        print(target)
    return EXIT_OK


def _write(path: str, text: str) -> None:
    try:
        with open(path, "w") as f:
            f.write(text)
    except OSError as err:
        raise KitError(f"cannot write {path} ({err.strerror}); pass --output to a writable file") from None
