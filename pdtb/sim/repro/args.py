"""What the reproductions share on the command line: one-line argparse errors, a config from the
flags.

What the `pdtb sim reproduce` commands share on their command line: argparse that fails in
one line, and a config dataclass built from the parsed flags (besides --json)."""
from __future__ import annotations

import argparse

from pdtb.common import CliError


class OneLineParser(argparse.ArgumentParser):
    def error(self, message: str):  # one line naming the command, not argparse's usage block
        raise CliError(f"{self.prog}: {message}")


def config_from(ap: argparse.ArgumentParser, argv: list[str] | None, cls):
    """(`cls(**flags)`, --json): flags the config refuses (its __post_init__) fail in one line."""
    a = vars(ap.parse_args(argv))
    as_json = a.pop("json")
    try:
        return cls(**a), as_json
    except ValueError as e:
        raise CliError(f"{ap.prog}: {e}") from None
