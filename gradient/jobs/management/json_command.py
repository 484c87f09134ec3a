"""The operator commands' shared contract (shared protocol.md, "Operator commands"): one JSON
object on stdout and exit 0, or one line on stderr and a non-zero exit with nothing written."""

import argparse
import json
import logging
import sys

from django.core.management.base import BaseCommand, CommandError


class Once(argparse.Action):
    """Stores an option and refuses it a second time: a repeat is likelier a slip than an
    override. As a flag: `add_argument("--x", action=Once, nargs=0, const=True, default=False)`."""

    seen = False  # a parser lives for one invocation, so per-instance state is per run

    def __call__(self, parser, namespace, values, option_string=None):
        if self.seen:
            raise argparse.ArgumentError(self, "given more than once")
        self.seen = True
        setattr(namespace, self.dest, self.const if self.nargs == 0 else values)


def text_problem(value: str) -> str | None:
    """Why PostgreSQL could not take this string as text, or None. argv reaches Python with
    undecodable bytes as lone surrogates, which no UTF-8 column can hold either."""
    if "\x00" in value:
        return "contains a NUL byte"
    try:
        value.encode()
    except UnicodeEncodeError:
        return "is not valid UTF-8"
    return None


def checked_name(model, value: str, what: str) -> str:
    """A unique name a model is looked up by: non-empty and within its column."""
    limit = model._meta.get_field("name").max_length
    if not value.strip():
        raise CommandError(f"{what} name must not be empty")
    if len(value) > limit:
        raise CommandError(f"{what} name is longer than {limit} characters")
    return value


class JsonCommand(BaseCommand):
    """Subclasses implement `run(**options) -> dict` and raise CommandError to refuse; every
    write they make belongs in one transaction, so a refusal leaves nothing behind."""

    labels: dict[str, str] = {}  # dest -> `--option` or `METAVAR`, set by create_parser

    def run(self, **options) -> dict:
        raise NotImplementedError

    def handle(self, *args, **options):
        self.check_text(options)
        # stderr is the error line's alone: the services' progress logs stay quiet here.
        logging.disable(logging.INFO)
        try:
            self.stdout.write(json.dumps(self.run(**options)))
        finally:
            logging.disable(logging.NOTSET)

    def check_text(self, options: dict) -> None:
        """Every string argument, refused here rather than by PostgreSQL as a DataError."""
        for dest, value in options.items():
            for item in value if isinstance(value, list) else [value]:
                problem = isinstance(item, str) and text_problem(item)
                if problem:
                    raise CommandError(f"argument {self.labels.get(dest, dest)} {problem}")

    def create_parser(self, prog_name, subcommand, **kwargs):
        parser = super().create_parser(prog_name, subcommand, **kwargs)
        # How each argument is spelled on the command line (`--project`, `NAME`), for errors.
        self.labels = {
            a.dest: max(a.option_strings, key=len) if a.option_strings else (a.metavar or a.dest)
            for a in parser._actions
        }
        # Usage errors raise CommandError, so they too come out as one line (run_from_argv).
        parser.called_from_command_line = False
        return parser

    def run_from_argv(self, argv):
        try:
            super().run_from_argv(argv)
        except CommandError as e:
            # Only a usage error gets here: Django reports the command's own refusals itself,
            # unless --traceback asked for the raise.
            if "--traceback" in argv:
                raise
            self.stderr.write(f"CommandError: {e}")
            sys.exit(e.returncode)
