"""The YAML files a user hands omni (a deploy config, vLLM's --config FILE), read with a bound on their size.

An alias repeats the node it names without copying it, so a few hundred bytes of nested aliases load in
microseconds as a shared graph, and merging, hashing or printing the config then expands it to billions of
nodes (a 549-byte deploy: 31 s and 7 GB before a MemoryError). The loaded graph is walked as a copy would be,
each alias counting as often as it is used, and refused past MAX_NODES.
"""

from __future__ import annotations

from typing import IO, Any

import yaml

from omni.errors import ConfigError

# The bundled deploys hold under 200 nodes each; a hand-written one stays far below this.
MAX_NODES = 100_000


def safe_load(stream: IO[str], where: str) -> Any:
    """yaml.safe_load, refusing a document that expands past MAX_NODES (`where`: the file, as errors name it)."""
    data = yaml.safe_load(stream)
    check_size(data, where)
    return data


def check_size(data: Any, where: str, limit: int = MAX_NODES) -> None:
    # Iterative: a recursive alias (`a: &a [*a]`) only ever adds to the count, never to the depth.
    count, todo = 0, [data]
    while todo:
        node = todo.pop()
        count += 1
        if count > limit:
            raise ConfigError(f"{where}: the YAML expands to more than {limit} nodes (its aliases, *name, repeat "
                              "what they name, or one refers to itself); write the values out, or alias less")
        if isinstance(node, dict):
            todo.extend(node)
            todo.extend(node.values())
        elif isinstance(node, list):
            todo.extend(node)
