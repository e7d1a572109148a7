"""Typed dataclass configs and the flat CLI flags generated from them."""

from rlhfkit.config.base import arg, build_parser, flag_table, iter_fields, parse_config

__all__ = ["arg", "build_parser", "flag_table", "iter_fields", "parse_config"]
