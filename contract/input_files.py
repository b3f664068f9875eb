"""Reading user-supplied files within limits: size, encoding, nesting, aliases, numbers.

Model
-----
Every file a gpuslice command takes (a kubectl snapshot, a workload or cluster description, an
openb CSV, an agent spec, a catalog override) goes through this module before any of its
content is used, so a malformed or hostile file ends in :class:`InputError` -- a message naming
the file, the place and the fix -- never in a traceback or a hang:

* **size**: at most ``max_bytes`` are read (:data:`MAX_DOCUMENT_BYTES` by default, at most
  :data:`MAX_YAML_BYTES` for YAML, which is parsed in pure Python; the caller picks
  :data:`MAX_SNAPSHOT_BYTES` or :data:`MAX_TABLE_BYTES` for bigger kinds); a directory, a
  missing or unreadable file is named with the reason.
* **encoding**: UTF-8, with or without a byte-order mark; UTF-16 and UTF-32 with a BOM (what
  Windows tools write, e.g. PowerShell's ``>``).  Anything else is named with the offset of the
  first bad byte.
* **JSON** (:func:`parse_json`): standard JSON only -- ``NaN``/``Infinity`` are refused, as are
  numbers that overflow a float (``1e400``) or an int64, and duplicate keys in an object.
  Nesting beyond :data:`MAX_DEPTH` levels is refused.
* **YAML** (:func:`parse_yaml`): the safe loader (plain data only), plus: aliases may not
  expand the document beyond :data:`MAX_VALUES` values (a "billion laughs" is refused after
  composing, before anything is built), no recursive aliases, nesting at most
  :data:`MAX_DEPTH` levels, duplicate keys refused (YAML merge keys ``<<`` still work), floats
  finite (``.nan``/``.inf`` refused) and integers within int64.

The limits are generous for real inputs (a 5,000-node kubectl dump is far below the snapshot
size; hand-written documents nest less than 20 levels) and small enough that no input can make
a command run for long before it is refused.
"""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path
from typing import Any, Literal

import yaml
from yaml.nodes import MappingNode, Node, ScalarNode, SequenceNode

__all__ = [
    "MAX_DEPTH",
    "MAX_DOCUMENT_BYTES",
    "MAX_GPUS_PER_NODE",
    "MAX_INT",
    "MAX_SNAPSHOT_BYTES",
    "MAX_TABLE_BYTES",
    "MAX_VALUES",
    "MAX_YAML_BYTES",
    "InputError",
    "decode_text",
    "load_document",
    "parse_json",
    "parse_yaml",
    "read_bytes",
    "read_text",
]

MiB = 1024 * 1024
MAX_DOCUMENT_BYTES = 32 * MiB
"""JSON documents: workloads, clusters, agent specs, catalog overrides."""
MAX_YAML_BYTES = 4 * MiB
"""YAML documents (parsed in pure Python, about 1 MB/s, so that no file takes long)."""
MAX_SNAPSHOT_BYTES = 512 * MiB
"""``kubectl get nodes,pods,nodepartitionings -A -o json`` dumps."""
MAX_TABLE_BYTES = 256 * MiB
"""openb CSV tables."""
MAX_DEPTH = 64
"""Nesting levels of a document (Kubernetes objects need about 15)."""
MAX_VALUES = 5_000_000
"""Values (scalars, lists, mappings) of a YAML document once its aliases are expanded."""
MAX_INT = 2**63 - 1
"""Largest integer magnitude accepted anywhere (Kubernetes' int64)."""
MAX_GPUS_PER_NODE = 64
"""Physical GPUs of one node (today's largest servers have 16)."""

Format = Literal["json", "yaml"]


class InputError(ValueError):
    """A user-supplied file cannot be used; the message names the file, the place and the fix."""


def read_bytes(
    path: str | Path, what: str, max_bytes: int = MAX_DOCUMENT_BYTES, fix: str = ""
) -> bytes:
    """The bytes of the file ``path`` (``-``: standard input), at most ``max_bytes``; ``fix``
    replaces the advice given when the file is larger."""
    where = "standard input" if str(path) == "-" else str(path)
    too_big = InputError(
        f"{what} file {where} is larger than {max_bytes // MiB} MiB, the limit for a {what} "
        f"file; {fix or 'split it or remove what gpuslice does not read'}"
    )
    if str(path) == "-":
        data: bytes = sys.stdin.buffer.read(max_bytes + 1)
    else:
        try:
            with open(path, "rb") as fh:
                if os.fstat(fh.fileno()).st_size > max_bytes:  # a regular file: say so at once
                    raise too_big
                data = fh.read(max_bytes + 1)  # also bounds pipes and devices
        except IsADirectoryError:
            raise InputError(f"{what} file {where} is a directory; give a file") from None
        except OSError as e:
            raise InputError(f"cannot read {what} file {where}: {e.strerror or e}") from None
    if len(data) > max_bytes:
        raise too_big
    return data


_BOMS = (
    (b"\x00\x00\xfe\xff", "utf-32-be"),
    (b"\xff\xfe\x00\x00", "utf-32-le"),
    (b"\xef\xbb\xbf", "utf-8"),
    (b"\xfe\xff", "utf-16-be"),
    (b"\xff\xfe", "utf-16-le"),
)


def decode_text(data: bytes, where: str) -> str:
    """Text of ``data``: UTF-8 (BOM optional), or UTF-16/32 with a BOM (module docstring)."""
    encoding = "utf-8"
    for bom, enc in _BOMS:
        if data.startswith(bom):
            data, encoding = data[len(bom) :], enc
            break
    try:
        return data.decode(encoding)
    except UnicodeDecodeError as e:
        raise InputError(
            f"{where}: not {encoding.upper()} text (byte 0x{data[e.start]:02x} at offset "
            f"{e.start}); save the file as UTF-8"
        ) from None


def read_text(
    path: str | Path, what: str, max_bytes: int = MAX_DOCUMENT_BYTES, fix: str = ""
) -> str:
    """:func:`read_bytes` then :func:`decode_text`."""
    where = "standard input" if str(path) == "-" else str(path)
    return decode_text(read_bytes(path, what, max_bytes, fix), where)


# -- JSON ---------------------------------------------------------------------------------------


class _Refused(Exception):
    """Raised from inside the JSON parser's hooks; becomes an InputError naming the file."""


def _object(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise _Refused(f"duplicate key {key!r} in one object; keep one")
        out[key] = value
    return out


def _float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise _Refused(f"number {text[:40]} does not fit a float; use a smaller value")
    return value


def _int(text: str) -> int:
    if len(text) > 20:  # before int(): huge literals are slow to convert
        raise _Refused(f"integer {text[:40]}... has {len(text)} digits; the limit is int64")
    value = int(text)
    if abs(value) > MAX_INT:
        raise _Refused(f"integer {text} is beyond int64; use a smaller value")
    return value


def _constant(name: str) -> Any:
    raise _Refused(f"{name} is not a JSON number; use a finite number")


def _check_depth(doc: Any, where: str) -> None:
    stack: list[tuple[Any, int]] = [(doc, 1)]
    while stack:
        value, depth = stack.pop()
        if isinstance(value, dict | list):
            if depth > MAX_DEPTH:
                raise InputError(
                    f"{where}: nested more than {MAX_DEPTH} levels deep; flatten the document"
                )
            children = value.values() if isinstance(value, dict) else value
            stack.extend((c, depth + 1) for c in children if isinstance(c, dict | list))


def parse_json(text: str, where: str, *, check_depth: bool = True) -> Any:
    """Standard JSON (module docstring); ``check_depth=False`` leaves nesting to the parser's
    own recursion limit (for very large dumps, whose readers walk only known fields)."""
    try:
        doc = json.loads(
            text,
            object_pairs_hook=_object,
            parse_float=_float,
            parse_int=_int,
            parse_constant=_constant,
        )
    except json.JSONDecodeError as e:
        raise InputError(
            f"{where}: not valid JSON: {e.msg} at line {e.lineno} column {e.colno}"
        ) from None
    except _Refused as e:
        raise InputError(f"{where}: {e}") from None
    except RecursionError:
        raise InputError(
            f"{where}: nested more than {MAX_DEPTH} levels deep; flatten the document"
        ) from None
    if check_depth:
        _check_depth(doc, where)
    return doc


# -- YAML ---------------------------------------------------------------------------------------


class _Loader(yaml.SafeLoader):
    """The safe loader with deep nesting, duplicate keys, non-finite floats and huge integers
    refused.  Nesting is stopped in the scanner, token by token: PyYAML's scanner does work
    proportional to the flow depth for every token, so a file of brackets alone would
    otherwise take quadratic time before any later check ran."""

    def _too_deep(self) -> yaml.scanner.ScannerError:
        return yaml.scanner.ScannerError(
            None, None, f"nested more than {MAX_DEPTH} levels deep", self.get_mark()
        )

    def fetch_flow_collection_start(self, TokenClass: Any) -> None:
        super().fetch_flow_collection_start(TokenClass)
        if self.flow_level > MAX_DEPTH:
            raise self._too_deep()

    def add_indent(self, column: int) -> bool:
        added: bool = super().add_indent(column)
        if len(self.indents) > MAX_DEPTH:
            raise self._too_deep()
        return added

    def construct_mapping(self, node: MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: set[str] = set()
        for key, _ in node.value:
            if isinstance(key, ScalarNode) and key.tag != "tag:yaml.org,2002:merge":
                if key.value in seen:
                    raise yaml.constructor.ConstructorError(
                        None, None, f"duplicate key {key.value!r}; keep one", key.start_mark
                    )
                seen.add(key.value)
        return super().construct_mapping(node, deep)

    def construct_yaml_float(self, node: ScalarNode) -> float:
        value: float = super().construct_yaml_float(node)
        if not math.isfinite(value):
            raise yaml.constructor.ConstructorError(
                None, None, f"{node.value!r} is not a finite number", node.start_mark
            )
        return value

    def construct_yaml_int(self, node: ScalarNode) -> int:
        if len(str(node.value)) > 40:
            raise yaml.constructor.ConstructorError(
                None, None, f"integer {str(node.value)[:40]}... is beyond int64", node.start_mark
            )
        value: int = super().construct_yaml_int(node)
        if abs(value) > MAX_INT:
            raise yaml.constructor.ConstructorError(
                None, None, f"integer {node.value} is beyond int64", node.start_mark
            )
        return value


_Loader.add_constructor("tag:yaml.org,2002:float", _Loader.construct_yaml_float)
_Loader.add_constructor("tag:yaml.org,2002:int", _Loader.construct_yaml_int)


def _children(node: Node) -> list[Node]:
    if isinstance(node, SequenceNode):
        return list(node.value)
    if isinstance(node, MappingNode):
        return [n for pair in node.value for n in pair]
    return []


def _check_graph(root: Node, where: str) -> None:
    """Depth, cycles and expanded size of a composed YAML node graph (aliases share nodes)."""
    size: dict[int, int] = {}
    depth: dict[int, int] = {}
    on_path: set[int] = set()
    stack: list[tuple[Node, bool]] = [(root, False)]
    while stack:
        node, done = stack.pop()
        key = id(node)
        if done:
            kids = _children(node)
            size[key] = 1 + sum(size[id(k)] for k in kids)
            depth[key] = 1 + max((depth[id(k)] for k in kids), default=0)
            on_path.discard(key)
            if size[key] > MAX_VALUES:
                raise InputError(
                    f"{where}: its aliases expand to more than {MAX_VALUES:,} values (a YAML "
                    "alias bomb); write the data out or use fewer aliases"
                )
            if depth[key] > MAX_DEPTH:
                raise InputError(
                    f"{where}: nested more than {MAX_DEPTH} levels deep; flatten the document"
                )
            continue
        if key in size:
            continue
        if key in on_path:
            mark = node.start_mark
            raise InputError(
                f"{where}: line {mark.line + 1}: a recursive alias (a value that contains "
                "itself); write the data out"
            )
        on_path.add(key)
        stack.append((node, True))
        stack.extend((k, False) for k in _children(node) if id(k) not in size)


def parse_yaml(text: str, where: str) -> Any:
    """YAML through the bounded safe loader (module docstring)."""
    try:
        loader = _Loader(text)
    except yaml.YAMLError as e:  # the reader refuses control characters at once
        raise InputError(f"{where}: not valid YAML: {e}") from None
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        _check_graph(node, where)
        return loader.construct_document(node)
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        at = f" at line {mark.line + 1} column {mark.column + 1}" if mark else ""
        problem = e.problem or e.context or "invalid"
        raise InputError(f"{where}: not valid YAML{at}: {problem}") from None
    except yaml.YAMLError as e:
        raise InputError(f"{where}: not valid YAML: {e}") from None
    except RecursionError:
        raise InputError(
            f"{where}: nested more than {MAX_DEPTH} levels deep; flatten the document"
        ) from None
    finally:
        loader.dispose()


def load_document(
    path: str | Path,
    what: str,
    *,
    fmt: Format | None = None,
    max_bytes: int = MAX_DOCUMENT_BYTES,
) -> Any:
    """Read and parse a JSON or YAML file (``fmt``; default: JSON for ``.json``, else YAML)."""
    where = "standard input" if str(path) == "-" else str(path)
    if fmt is None:
        fmt = "json" if str(path).lower().endswith(".json") else "yaml"
    fix = ""
    if fmt == "yaml" and max_bytes > MAX_YAML_BYTES:
        max_bytes = MAX_YAML_BYTES
        fix = f"write it as JSON (up to {MAX_DOCUMENT_BYTES // MiB} MiB) or split it"
    text = read_text(path, what, max_bytes, fix)
    return parse_json(text, where) if fmt == "json" else parse_yaml(text, where)
