"""Hostfiles and DeepSpeed's ``--include`` / ``--exclude`` / ``--num_nodes`` / ``--num_gpus`` filters.

A hostfile names one host per line with its slot count, exactly as DeepSpeed reads it::

    # comments and blank lines are ignored
    worker-0 slots=4
    worker-1 slots=4

A *resource map* is an ordered ``{host: [slot, ...]}`` dict: which device slots of which host
the job uses. Order matters: the first host is the master and node ranks follow it.

Filters use DeepSpeed's syntax: ``NODE[:SLOT[,SLOT...]][@NODE...]``, e.g.
``worker-0@worker-1:0,2`` (all of worker-0, slots 0 and 2 of worker-1).
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import Dict, List, Optional

from ..errors import LaunchError

Resources = Dict[str, List[int]]

# "host slots=N" with optional trailing comment; host names are anything without spaces or '='.
_LINE = re.compile(r"^(?P<host>[^\s=#]+)\s+slots\s*=\s*(?P<slots>\d+)\s*(#.*)?$")


def parse_hostfile(text: str, source: str = "hostfile") -> Dict[str, int]:
    """Parse hostfile text into ``{host: slot_count}`` (file order kept).

    Raises ``LaunchError`` naming the line for malformed lines, zero slots and duplicate hosts.
    """
    hosts: Dict[str, int] = {}
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        match = _LINE.match(line)
        if match is None:
            raise LaunchError(f"{source} line {number}: {raw.strip()!r} is not 'HOST slots=N' "
                              f"(e.g. 'worker-0 slots=4'); fix or comment out the line")
        host, slots = match.group("host"), int(match.group("slots"))
        if slots < 1:
            raise LaunchError(f"{source} line {number}: host {host!r} has slots={slots}; "
                              f"slots must be at least 1 (remove the line to skip the host)")
        if host in hosts:
            raise LaunchError(f"{source} line {number}: host {host!r} is listed twice; "
                              f"list each host once with its total slots")
        hosts[host] = slots
    if not hosts:
        raise LaunchError(f"{source} names no hosts; add lines like 'worker-0 slots=4'")
    return hosts


def read_hostfile(path: Optional[str], required: bool) -> Optional[Dict[str, int]]:
    """Read a hostfile; ``None`` when it does not exist and was not asked for explicitly."""
    if not path:
        return None
    file = Path(path)
    if not file.is_file():
        if required:
            raise LaunchError(f"hostfile {str(file)!r} does not exist; pass an existing file to "
                              f"-H/--hostfile or leave the flag out for a single-node run")
        return None
    return parse_hostfile(file.read_text(encoding="utf-8"), source=f"hostfile {str(file)!r}")


def parse_filter(spec: str, flag: str = "--include") -> Dict[str, Optional[List[int]]]:
    """Parse ``worker-0@worker-1:0,2`` into ``{"worker-0": None, "worker-1": [0, 2]}``.

    ``None`` means "the whole host". Slots are de-duplicated and sorted.
    """
    result: Dict[str, Optional[List[int]]] = {}
    for part in spec.split("@"):
        part = part.strip()
        if not part:
            raise LaunchError(f"{flag} {spec!r} has an empty node entry; use "
                              f"'NODE[:SLOT,SLOT]@NODE...' (e.g. 'worker-0@worker-1:0,2')")
        host, _, slots_text = part.partition(":")
        if not host:
            raise LaunchError(f"{flag} {spec!r}: entry {part!r} has no host name before ':'")
        if host in result:
            raise LaunchError(f"{flag} {spec!r} names host {host!r} twice; merge its slots "
                              f"into one entry ('{host}:0,1')")
        if not _:
            result[host] = None
            continue
        try:
            slots = sorted({int(s) for s in slots_text.split(",")})
        except ValueError:
            raise LaunchError(f"{flag} {spec!r}: slots {slots_text!r} of host {host!r} must be "
                              f"comma-separated integers (e.g. '{host}:0,2')") from None
        if any(s < 0 for s in slots):
            raise LaunchError(f"{flag} {spec!r}: slot numbers of host {host!r} must be >= 0")
        result[host] = slots
    return result


def _check_known(hosts: Resources, wanted: Dict[str, Optional[List[int]]], flag: str) -> None:
    for host, slots in wanted.items():
        if host not in hosts:
            raise LaunchError(f"{flag} names host {host!r}, which is not in the hostfile "
                              f"(known: {', '.join(hosts)}); fix the name or the hostfile")
        unknown = [s for s in (slots or []) if s not in hosts[host]]
        if unknown:
            raise LaunchError(f"{flag} names slot(s) {unknown} of host {host!r}, which has slots "
                              f"{hosts[host]}; pick slots that exist")


def filter_resources(hosts: Resources, include: str = "", exclude: str = "") -> Resources:
    """Apply ``--include`` or ``--exclude`` (not both) to a resource map.

    Include keeps only what it names; exclude removes what it names. Hosts left with no slots
    are dropped. Raises ``LaunchError`` on unknown hosts/slots or when nothing is left.
    """
    if include and exclude:
        raise LaunchError("--include and --exclude are mutually exclusive; use one of them")
    if include:
        wanted = parse_filter(include, "--include")
        _check_known(hosts, wanted, "--include")
        # Hostfile order, not the filter's order: the master host stays first.
        result = {h: list(wanted[h] if wanted[h] is not None else s)
                  for h, s in hosts.items() if h in wanted}
    elif exclude:
        dropped = parse_filter(exclude, "--exclude")
        _check_known(hosts, dropped, "--exclude")
        result = {}
        for host, slots in hosts.items():
            if host in dropped and dropped[host] is None:
                continue
            kept = [s for s in slots if s not in (dropped.get(host) or [])]
            if kept:
                result[host] = kept
    else:
        result = {h: list(s) for h, s in hosts.items()}
    if not result:
        raise LaunchError(f"--include {include!r} / --exclude {exclude!r} leave no slots to run "
                          f"on; keep at least one host slot")
    return result


def limit_resources(hosts: Resources, num_nodes: int = -1, num_gpus: int = -1) -> Resources:
    """Keep the first ``num_nodes`` hosts and the first ``num_gpus`` slots of each (-1: all)."""
    if num_nodes == 0 or num_nodes < -1:
        raise LaunchError(f"--num_nodes {num_nodes} is invalid; give a positive count or omit it")
    if num_gpus == 0 or num_gpus < -1:
        raise LaunchError(f"--num_gpus {num_gpus} is invalid; give a positive count or omit it")
    if num_nodes > len(hosts):
        raise LaunchError(f"--num_nodes {num_nodes} asks for more nodes than the {len(hosts)} "
                          f"available ({', '.join(hosts)}); lower it or add hosts")
    names = list(hosts)[: num_nodes if num_nodes > 0 else None]
    result: Resources = {}
    for host in names:
        slots = hosts[host]
        if num_gpus > len(slots):
            raise LaunchError(f"--num_gpus {num_gpus} is more than the {len(slots)} slot(s) of "
                              f"host {host!r}; lower --num_gpus or raise slots= in the hostfile")
        result[host] = slots[: num_gpus if num_gpus > 0 else None]
    return result


def expand_slots(hosts: Dict[str, int]) -> Resources:
    """``{host: count}`` to ``{host: [0..count-1]}``."""
    return {host: list(range(count)) for host, count in hosts.items()}
