"""The `pdserve` command: one entry point, one subcommand per part of the system.

Each subcommand lives beside the code it drives and exposes two functions,
``add_arguments(parser)`` and ``run(args) -> int``; this file only wires them,
importing each lazily so that `pdserve plan` starts without torch.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

from pdserve.flags import config_first

# name -> (module, one-line help)
SUBCOMMANDS = {
    "serve": ("pdserve.server.cli", "serve the OpenAI-compatible API"),
    "router": ("pdserve.router.cli", "the router: OpenAI API in front of prefill and decode workers"),
    "worker": ("pdserve.worker.cli", "one engine worker (prefill, decode or both) that joins a router"),
    "scale": ("pdserve.router.scale_cli", "grow or shrink a running deployment's prefill and decode pools"),
    "internal": ("pdserve.internal_cli", "call a deployment's /internal route, signed with the cluster secret"),
    "bench": ("pdserve.bench.cli", "benchmark an OpenAI-compatible endpoint"),
    "generate": ("pdserve.engine.cli", "generate text offline with the engine"),
    "convert": ("pdserve.engine.convert", "write a model out as a Hugging Face directory"),
    "plan": ("pdserve.planner.cli", "capacity planning: memory, roofline, P:D ratio, GPU count"),
    "sim": ("pdserve.sim.cli", "discrete-event simulation of a serving cluster"),
}


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """Only the chosen subcommand's module is imported, so one part's import
    cost (torch) or breakage never reaches another part's command."""
    parser = argparse.ArgumentParser(prog="pdserve", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (module, help_text) in SUBCOMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        p.set_defaults(_module=module)
        if name != command:
            continue
        try:
            importlib.import_module(module).add_arguments(p)
        except ModuleNotFoundError as e:  # a part not built yet
            if not e.name or not e.name.startswith("pdserve"):
                raise
            p.set_defaults(_missing=str(e))
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = config_first(sys.argv[1:] if argv is None else list(argv))  # the command line wins over --config
    command = next((a for a in argv if not a.startswith("-")), None)
    parser = build_parser(command)
    args = parser.parse_args(argv)
    for name in ("port", "router_port"):  # an operator's typo, not an OverflowError from bind()
        port = getattr(args, name, None)
        if isinstance(port, int) and not 0 <= port <= 65535:
            parser.error(f"--{name.replace('_', '-')} {port}: a port is 0-65535")
    if getattr(args, "enable_auto_tool_choice", False) and not getattr(args, "tool_call_parser", None):
        parser.error("--enable-auto-tool-choice needs --tool-call-parser (the model's tool-call syntax)")
    if hasattr(args, "generation_config"):  # a file or override no request could use: now, not in a child
        from pdserve.config import ConfigError
        from pdserve.engine.generation_config import sampling_defaults

        try:
            sampling_defaults(getattr(args, "model", None), args.generation_config, args.override_generation_config)
        except ConfigError as e:
            parser.error(str(e))
    if getattr(args, "lora_modules", None):  # a bad spec, or an adapter the base model's name would hide
        from pdserve.config import ConfigError
        from pdserve.engine.lora import parse_modules

        try:
            clash = {n for n, _ in parse_modules(args.lora_modules)} & set(
                getattr(args, "served_model_name", None) or []
            )
        except ConfigError as e:
            parser.error(str(e))
        if clash:
            parser.error(f"--lora-modules {sorted(clash)}: the name of a served model (--served-model-name)")
    if getattr(args, "internal_aliases", None):
        from pdserve import auth

        for alias in args.internal_aliases:
            try:
                auth.target_of(alias if "://" in alias else f"http://{alias}")
            except Exception as e:  # httpx's InvalidURL and its kin: an operator's typo
                parser.error(f"--internal-aliases {alias}: not a HOST:PORT ({e})")
    if getattr(args, "_missing", None):
        print(f"pdserve {args.command}: not available ({args._missing})", file=sys.stderr)
        return 2
    try:
        return int(importlib.import_module(args._module).run(args) or 0)
    except BrokenPipeError:
        if args.command in SERVERS:
            raise  # a server's broken pipe is a fault to report, not a reader that left
        # the reader went away (`pdserve plan --json | head`): end quietly, as Unix tools do;
        # stdout is pointed at /dev/null so the interpreter's final flush does not fail again
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141  # 128 + SIGPIPE, what a shell reports for a tool a pipe ended


# long-running processes: their output is a log, and a BrokenPipeError there is a real fault
SERVERS = frozenset({"serve", "router", "worker"})


if __name__ == "__main__":
    sys.exit(main())
