"""The command line of ``offload finetune`` (and ``scripts/finetune_100b.py``), built from the config.

Every flag is a field of ``config.TrainConfig``: its name, default, help and check come from the
field's declaration, so the command line and the TOML file cannot drift apart. Flags given on the
command line override ``--config FILE``'s values, which override the defaults.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys

from .config import TrainConfig, load_config, sections, with_values

CONFIG_HELP = "read settings from this TOML file (one table per section: [model], [data], ...); flags override it"


def flag_name(f: dataclasses.Field) -> str:
    return f.metadata["flag"] or "--" + f.name.replace("_", "-")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``--config`` and one flag per config field, grouped by section. No flag has an argparse
    default: what was not given is absent from the namespace (``config_from_args`` keeps the
    file's value or the field's default)."""
    parser.add_argument("--config", metavar="FILE", help=CONFIG_HELP)
    for section, cls in sections().items():
        group = parser.add_argument_group(f"{section} ([{section}] in --config)", cls.__doc__)
        for f in dataclasses.fields(cls):
            default = f.default_factory()
            kwargs = {"dest": f"{section}.{f.name}", "default": argparse.SUPPRESS}
            if f.type == "bool":
                group.add_argument(flag_name(f), action="store_true", help=f.metadata["help"], **kwargs)
                continue
            shown = "" if default in (None, []) else f" (default {default})"
            if f.type == "list":
                kwargs.update(action="append", type=str)
            else:
                kwargs["type"] = f.metadata["check"]
            group.add_argument(flag_name(f), metavar=f.metadata["metavar"] or f.name.upper(), help=f.metadata["help"] + shown,
                               **kwargs)


def build_parser(description: str | None = None, *, quiet: bool = False) -> argparse.ArgumentParser:
    """The parser on its own (``quiet``: exit 2 without a word on a bad command line -- ranks
    other than 0 under torchrun, where rank 0 says it)."""
    parser = argparse.ArgumentParser(prog="offload finetune", description=description,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    if quiet:
        parser.error = lambda message: sys.exit(2)
    add_arguments(parser)
    return parser


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    """The run's config: ``--config FILE`` (if given) with the flags given on top."""
    config = load_config(args.config) if getattr(args, "config", None) else TrainConfig()
    values: dict[str, dict] = {}
    for key, value in vars(args).items():
        if "." in key:
            section, name = key.split(".", 1)
            values.setdefault(section, {})[name] = value
    given = values.get("model", {})
    for chosen, other in (("model", "preset"), ("preset", "model")):   # one choice: the flag's replaces the file's
        if chosen in given and other not in given:
            given[other] = None
    return with_values(config, values)


def parse(argv: list[str] | None = None, *, quiet: bool = False) -> TrainConfig:
    """``argv`` (default ``sys.argv[1:]``) as a config; a bad flag exits 2 naming it."""
    return config_from_args(build_parser(quiet=quiet).parse_args(argv))
