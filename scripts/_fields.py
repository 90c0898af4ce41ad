"""Configuration fields written on a command line (``from _fields import parse_fields``; the scripts' folder on
``sys.path``): ``name=value,...`` as a dict of integers, booleans (``True`` / ``False``, any case) and, for the
rest, the text -- what ``--config``, ``--take`` and the probes' ``name:field=value,...`` arguments hold."""
from __future__ import annotations


def parse_fields(text: str) -> dict:
    """``"block_n=128,persistent=True,split=kv"`` -> ``{"block_n": 128, "persistent": True, "split": "kv"}``;
    ValueError for an item that is not ``name=value``."""
    fields = {}
    for item in filter(None, text.split(",")):
        name, sep, value = (part.strip() for part in item.partition("="))
        if not sep or not name or not value:
            raise ValueError(f"expected name=value items separated by commas, got {item!r}")
        if value.lstrip("-").isdigit():
            fields[name] = int(value)
        else:
            fields[name] = {"true": True, "false": False}.get(value.lower(), value)
    return fields


def named_configs(args, make) -> dict:
    """``{name: make(**fields)}`` of the arguments written ``name:field=value,...`` (the others are skipped)."""
    named = {}
    for arg in args:
        if ":" in arg:
            name, fields = arg.split(":", 1)
            named[name] = make(**parse_fields(fields))
    return named
