"""Malformed inputs: every file-taking command exits 2 naming the file and the object, fast.

The corpus (tests/malformed_corpus.py, also runnable as ``python tests/malformed_corpus.py``)
holds several hundred damaged files across ``plan --snapshot/--catalog``, ``simulate
--trace/--cluster`` (YAML, JSON, CSV), ``sweep --trace/--cluster`` and ``agent --fake
--spec/--catalog``; the unit tests below pin the reading rules of contract.input_files.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from malformed_corpus import all_cases, run_corpus

from contract.input_files import (
    MAX_DEPTH,
    InputError,
    decode_text,
    load_document,
    parse_json,
    parse_yaml,
    read_bytes,
)

SLOW_S = 10.0


def test_malformed_input_corpus_is_refused_cleanly_and_fast(tmp_path: Path) -> None:
    cases = all_cases()
    t0 = time.perf_counter()
    outcomes = run_corpus(cases, tmp_path)
    took = time.perf_counter() - t0
    tracebacks = [o for o in outcomes if o.traceback]
    slow = [o for o in outcomes if o.killed or o.seconds > SLOW_S]
    unclean = [o for o in outcomes if o.problems]
    commands = sorted({c.argv[0] for c in cases})
    print(
        f"\nmalformed inputs: {len(outcomes)} inputs over {', '.join(commands)}; "
        f"{sum(o.rc == 2 for o in outcomes)} exit 2, {len(tracebacks)} tracebacks, "
        f"{len(slow)} over {SLOW_S:.0f} s, {len(unclean)} not clean; max "
        f"{max(o.seconds for o in outcomes):.2f} s per input, {took:.1f} s in all"
    )
    assert len(outcomes) >= 200 and set(commands) == {"agent", "plan", "simulate", "sweep"}
    assert not tracebacks, [(o.case.name, o.traceback[-500:]) for o in tracebacks[:5]]
    assert not slow, [(o.case.name, o.seconds) for o in slow]
    assert not unclean, [(o.case.name, o.problems) for o in unclean[:10]]


# -- the reading rules ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("data", "text"),
    [
        (b"\xef\xbb\xbfa: 1", "a: 1"),
        ("a: \u00e9".encode("utf-16"), "a: \u00e9"),
        ("a: \u00e9".encode("utf-16-be").join([b"\xfe\xff", b""]), "a: \u00e9"),
        ("a: \u00e9".encode("utf-32"), "a: \u00e9"),
        (b"plain", "plain"),
    ],
)
def test_byte_order_marks_are_honoured(data: bytes, text: str) -> None:
    assert decode_text(data, "f") == text


@pytest.mark.parametrize("data", [b"a: \xff", b"\x80abc", b"\xc3"])
def test_text_that_is_not_utf8_names_the_offset(data: bytes) -> None:
    with pytest.raises(InputError, match=r"f\.yaml: not UTF-8 text \(byte 0x[0-9a-f]{2} at offset"):
        decode_text(data, "f.yaml")


def test_nesting_is_allowed_to_the_limit_and_refused_beyond() -> None:
    ok = "[" * MAX_DEPTH + "]" * MAX_DEPTH
    assert parse_json(ok, "f") is not None and parse_yaml(ok, "f") is not None
    deep = "[" * (MAX_DEPTH + 1) + "]" * (MAX_DEPTH + 1)
    for parse in (parse_json, parse_yaml):
        with pytest.raises(InputError, match=f"nested more than {MAX_DEPTH} levels"):
            parse(deep, "f")
    block = "".join("  " * i + "a:\n" for i in range(MAX_DEPTH + 2)) + "  " * (MAX_DEPTH + 2) + "1"
    with pytest.raises(InputError, match="nested more than"):
        parse_yaml(block, "f")


def test_yaml_aliases_work_but_cannot_explode_or_recurse() -> None:
    assert parse_yaml("d: &d {x: 1, y: 2}\ne:\n  <<: *d\n  x: 3\nf: *d\n", "f") == {
        "d": {"x": 1, "y": 2},
        "e": {"x": 3, "y": 2},
        "f": {"x": 1, "y": 2},
    }
    lines = ["a0: &a0 [x, x, x, x, x, x, x, x, x, x]"]
    lines += [f"a{k}: &a{k} [" + ", ".join([f"*a{k - 1}"] * 10) + "]" for k in range(1, 10)]
    t0 = time.perf_counter()
    with pytest.raises(InputError, match="alias bomb"):
        parse_yaml("\n".join(lines), "f")
    assert time.perf_counter() - t0 < 2
    with pytest.raises(InputError, match="recursive alias"):
        parse_yaml("a: &a {b: *a}", "f")


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('{"a": NaN}', "NaN is not a JSON number"),
        ('{"a": -Infinity}', "-Infinity is not a JSON number"),
        ('{"a": 1e400}', "does not fit a float"),
        ('{"a": 9223372036854775808}', "beyond int64"),
        ('{"a": ' + "1" * 5000 + "}", "5000 digits"),
        ('{"a": 1, "a": 2}', "duplicate key 'a'"),
    ],
)
def test_json_numbers_and_keys(text: str, message: str) -> None:
    with pytest.raises(InputError, match=message):
        parse_json(text, "f")


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("a: .nan", "not a finite number"),
        ("a: -.inf", "not a finite number"),
        ("a: 9223372036854775808", "beyond int64"),
        ("a: 1\nb: 2\na: 3", "line 3 column 1: duplicate key 'a'"),
        ("a: [1, 2", "not valid YAML"),
        ("a: \x00", "special characters"),
    ],
)
def test_yaml_numbers_keys_and_syntax(text: str, message: str) -> None:
    with pytest.raises(InputError, match=message):
        parse_yaml(text, "f")


def test_size_limits_are_checked_before_reading(tmp_path: Path) -> None:
    big = tmp_path / "big.json"
    with open(big, "wb") as fh:
        fh.truncate(2 * 1024 * 1024 * 1024)  # sparse: nothing is read
    with pytest.raises(InputError, match=r"larger than 1 MiB, the limit for a snapshot file"):
        read_bytes(big, "snapshot", 1024 * 1024)
    yml = tmp_path / "w.yaml"
    yml.write_text("a: 1\n" * 1_000_000)  # 5 MB of YAML: more than the YAML limit
    with pytest.raises(InputError, match="4 MiB, the limit for a workload file; write it as JSON"):
        load_document(yml, "workload")
    with pytest.raises(InputError, match="is a directory"):
        read_bytes(tmp_path, "workload")
