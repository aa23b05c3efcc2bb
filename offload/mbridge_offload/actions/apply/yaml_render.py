"""Put ``apply``'s key edits into the user's text, keeping every byte it does not change.

JSON is re-dumped; YAML is edited line by line (``yaml_edit``), else (unusual layouts) round-tripped with
ruamel.yaml, which keeps comments, key order and quoting. Never imports torch.
"""

from __future__ import annotations

import copy
import io
import json
from typing import Any

from mbridge_offload.actions.apply import yaml_edit
from mbridge_offload.actions.apply.result import ApplyError, Change
from mbridge_offload.config.sources import document_root, parse_text


def _yaml():
    from ruamel.yaml import YAML

    yaml = YAML(typ="rt")
    yaml.preserve_quotes = True
    yaml.width = 4096  # never re-wrap long lines the user wrote
    # Bridge's to_yaml() writes `null`, not an empty value.
    yaml.representer.add_representer(
        type(None), lambda rep, _data: rep.represent_scalar("tag:yaml.org,2002:null", "null")
    )
    return yaml


def _detect_indent(text: str) -> tuple[int, int, int]:
    """(mapping, sequence, offset) indentation used by the file, so re-dumping does not re-indent it."""
    for line in text.splitlines():
        stripped = line.lstrip(" ")
        if stripped and not stripped.startswith("#") and line != stripped:
            width = len(line) - len(stripped)
            return width, width, 0
    return 2, 2, 0


def _set_in_tree(tree: Any, dotted: str, value: Any, related: str | None) -> None:
    from ruamel.yaml.comments import CommentedMap

    section_name, _, key = dotted.partition(".")
    section = tree.get(section_name)
    if section is None:
        section = CommentedMap()
        tree[section_name] = section
    if key in section:
        section[key] = value
        return
    keys = list(section.keys())
    position = keys.index(related) + 1 if related in keys else len(keys)
    if position == len(keys) and keys:
        # Comment lines between this section and the next are stored on the section's last key, after that key's
        # own end-of-line comment; move those lines to the new last key so they stay above the next section.
        last = keys[-1]
        entry = section.ca.items.get(last)
        token = entry[2] if entry and len(entry) > 2 else None
        section.insert(position, key, value)
        if token is not None:
            text = token.value
            if text.lstrip(" ").startswith("#"):  # the last key's own end-of-line comment comes first
                eol, _, rest = text.partition("\n")
                eol += "\n"
            else:
                eol, rest = "", text
            if rest:
                moved = copy.copy(token)
                moved.value = "\n" + rest if eol else rest
                section.ca.items[key] = [None, None, moved, None]
                if eol:
                    token.value = eol
                else:
                    entry[2] = None
        return
    section.insert(position, key, value)


_NEIGHBOURS = {
    "optimizer.optimizer_offload_fraction": "optimizer_cpu_offload",
    "optimizer.overlap_cpu_optimizer_d2h_h2d": "optimizer_offload_fraction",
    "model.cpu_offloading_num_layers": "cpu_offloading",
    "model.cpu_offloading_activations": "cpu_offloading_num_layers",
}


def render(text: str, tree: Any, edits: list[Change], is_json: bool, plain: dict[str, Any]) -> str:
    """The edited text: JSON re-dumped; YAML edited line by line, else (unusual layouts) round-tripped."""
    if not is_json:
        edited = yaml_edit.line_edit(
            text, [(c.key, c.new) for c in edits], _NEIGHBOURS, lambda t: parse_text(t, "<edit>")[0]
        )
        if edited is not None:
            return edited
    if not is_json and tree is None:
        raise ApplyError("this YAML layout cannot be edited safely", "edit the keys by hand (see overrides)")
    if is_json:
        for change in edits:
            section, _, key = change.key.partition(".")
            plain.setdefault(section, {})[key] = change.new
        return json.dumps(plain, indent=2) + "\n"
    yaml = _yaml()
    mapping, sequence, offset = _detect_indent(text)
    yaml.indent(mapping=mapping, sequence=sequence, offset=offset)
    for change in edits:
        _set_in_tree(tree, change.key, change.new, _NEIGHBOURS.get(change.key))
    out = io.StringIO()
    yaml.dump(document_root(tree), out)  # a `ConfigContainer:` perf YAML keeps its wrapper
    return out.getvalue()
