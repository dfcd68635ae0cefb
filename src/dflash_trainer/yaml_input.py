"""YAML as the user writes it, without its two traps: aliases and duplicate keys.

An alias (`*name`) repeats a node by reference: nine nested lists of nine aliases are a
billion values (the "billion laughs"), built in memory by any consumer that walks them. No
config or recipe needs one, so an alias is an error naming its line. A key written twice in
one mapping silently keeps the last value in plain PyYAML: here it is an error naming the
key and both lines, because the first value is what the author usually meant to change.

Both errors are `yaml.MarkedYAMLError`s, so every caller's YAML error handling (line and
column in the message) covers them.
"""

from __future__ import annotations

from typing import Any

import yaml
from yaml.composer import ComposerError
from yaml.constructor import ConstructorError
from yaml.events import AliasEvent
from yaml.nodes import MappingNode, Node


class StrictLoader(yaml.SafeLoader):
    """SafeLoader that refuses aliases and duplicate mapping keys."""

    def compose_node(self, parent: Node | None, index: Any) -> Node | None:
        if self.check_event(AliasEvent):
            event = self.peek_event()
            raise ComposerError(
                None,
                None,
                f"alias *{event.anchor} refused: write the value out (aliases are not accepted, "
                "so a small file cannot expand to billions of values)",
                event.start_mark,
            )
        return super().compose_node(parent, index)

    def construct_mapping(self, node: MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: dict[Any, Any] = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            try:
                first = seen.get(key)
            except TypeError:  # an unhashable key: the base class reports it
                continue
            if first is not None:
                raise ConstructorError(
                    "while constructing a mapping",
                    node.start_mark,
                    f"duplicate key {key!r} (first at line {first.line + 1}); keep one",
                    key_node.start_mark,
                )
            seen[key] = key_node.start_mark
        return super().construct_mapping(node, deep=deep)


def strict_load(text: str) -> Any:
    """`yaml.safe_load(text)` without aliases or duplicate keys."""
    return yaml.load(text, Loader=StrictLoader)
