"""Thin entry points: parse, validate, call a trainer."""
