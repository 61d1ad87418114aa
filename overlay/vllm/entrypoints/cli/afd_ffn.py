# SPDX-License-Identifier: Apache-2.0
"""The ``vllm afd-ffn`` subcommand: the FFN role of Attention-FFN
Disaggregation."""

from __future__ import annotations

import argparse

from vllm.entrypoints.cli.types import CLISubcommand
from vllm.utils.argparse_utils import FlexibleArgumentParser

DESCRIPTION = """Run the FFN ranks of an Attention-FFN Disaggregation (AFD)
deployment: they load only the FFN weights of MODEL, hold no KV cache, and run
the MLP of every decoder layer for the attention ranks that connect to them.
Takes vLLM's engine arguments (model, dtype, load format, ...) and
--afd-config with "role": "ffn". Exits when the attention side shuts down."""


class AFDFFNSubcommand(CLISubcommand):
    name = "afd-ffn"

    @staticmethod
    def cmd(args: argparse.Namespace) -> None:
        from vllm.afd.ffn.server import run_ffn_server

        if getattr(args, "model_tag", None) is not None:
            args.model = args.model_tag
        run_ffn_server(args)

    def subparser_init(self, subparsers: argparse._SubParsersAction) -> FlexibleArgumentParser:
        from vllm.engine.arg_utils import EngineArgs

        parser = subparsers.add_parser(
            self.name,
            help="Run the FFN role of Attention-FFN Disaggregation.",
            description=DESCRIPTION,
            usage='vllm afd-ffn MODEL --afd-config \'{"role": "ffn", ...}\' [options]',
        )
        parser.add_argument("model_tag", nargs="?", help="The model (path or name).")
        return EngineArgs.add_cli_args(parser)


def cmd_init() -> list[CLISubcommand]:
    # Patch 0008 registers this module with vLLM's CLI; it brings AFD's
    # other subcommands along, so that they need no patch of their own.
    from vllm.entrypoints.cli import afd_plan

    return [AFDFFNSubcommand(), *afd_plan.cmd_init()]
