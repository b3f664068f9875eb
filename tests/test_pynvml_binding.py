"""The product's pynvml calls, checked against the real ``pynvml`` binding (no GPU needed).

``node_agent/nvml_pynvml.py`` (the adapter) and ``node_agent/catalog_probe.py`` are tested over
hand-written fakes (``FakePynvml`` / ``EventPynvml``, the probe's ``FakeDriver``); no GPU runs
them here.  A fake that mirrors the adapter's assumptions rather than NVIDIA's binding would let
a wrong function name, argument order or count, struct field, constant value, return type or
exception type pass every test and fail on the first real GPU.  This module guards against that
by reading the real binding -- ``pynvml.py`` of ``nvidia-ml-py``, imported, never initialised:
nothing here loads ``libnvidia-ml`` or needs a GPU or driver:

* every ``pynvml.<name>`` that the product code (every module under ``node_agent/`` and
  ``gpuslice/`` that mentions pynvml, parsed with ``ast``: a new call is checked without editing
  this file) uses exists, and every call site binds to the real function's signature, with each
  handle (device, GPU/compute instance, event set) where the binding takes it; arguments
  the binding hands to C unchanged as pointers (``*Ref``, ``placement``) are passed as
  ``ctypes.byref(...)`` or a ctypes array; functions the binding wraps in
  ``@throwOnVersionMismatch`` go through the adapter's ``_call``, which maps its error;
* ``NvmlErrorCode``, ``ComputeMode``, ``XID_NOT_MIG_SCOPED`` and the modules' ``_NVML_*``
  constants equal the binding's; the compute-instance profile map, the GPU-instance profile
  index range and the catalog's profile indexes and slice counts fit the binding's constants;
* the struct fields the code reads exist on the struct the binding returns (found in the
  binding's source, by version), and every camelCase attribute the code reads is one of them;
* the fakes expose every name the code uses, with the binding's value for constants and the
  binding's required arguments for functions, and define no ``nvml*`` function the binding
  lacks; driven through the adapter, ``FakePynvml`` returns what the binding returns (its struct
  classes, ``str`` where ``convertStrBytes`` decodes, ints, lists of ``nvmlFriendlyObject``);
* the error model: ``NVMLError(code)`` carries ``.value``; ``NVMLLibraryMismatchError`` is no
  ``NVMLError``; a device handle's identity (``_handle_key``) survives ``c_nvmlEventData_t``.
"""

from __future__ import annotations

import ast
import ctypes
import functools
import inspect
import re
import textwrap
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pynvml
import pytest

from node_agent.gpu_reset import NvidiaSmi
from node_agent.nvml import XID_NOT_MIG_SCOPED, ComputeMode, NvmlErrorCode
from node_agent.nvml_fake import FakeNvml
from node_agent.nvml_pynvml import _CI_PROFILE_FOR_SLICES, PynvmlAdapter, _handle_key
from planner.catalog import MigProfile, default_catalog
from tests.test_agent_catalog_probe import FakeDriver
from tests.test_agent_pynvml import FakePynvml
from tests.test_agent_xid import EventPynvml

ROOT = Path(__file__).resolve().parents[1]
ADAPTER = "node_agent/nvml_pynvml.py"
PROBE = "node_agent/catalog_probe.py"

READS: dict[str, set[str]] = {
    "nvmlDeviceGetPciInfo": {"pciDeviceId", "busId"},
    "nvmlDeviceGetMemoryInfo": {"total"},
    "nvmlDeviceGetGpuInstanceProfileInfo": {
        "id",
        "instanceCount",
        "sliceCount",
        "name",
        "memorySizeMB",
    },
    "nvmlGpuInstanceGetInfo": {"id", "profileId", "placement"},
    "nvmlGpuInstanceGetComputeInstanceProfileInfo": {"id", "instanceCount", "sliceCount"},
    "nvmlComputeInstanceGetInfo": {"id"},
    "nvmlDeviceGetComputeRunningProcesses": {"pid"},
    "nvmlEventSetWait_v2": {
        "device",
        "eventType",
        "eventData",
        "gpuInstanceId",
        "computeInstanceId",
    },
}
"""Fields the product code reads from each function's result (``start``/``size`` of a
placement are checked on ``c_nvmlGpuInstancePlacement_t``)."""

RETURN_NOT_CHECKED = {
    "nvmlEventSetWait_v2": "EventPynvml (tests/test_agent_xid.py) returns an object whose "
    "device is the fake's handle tuple; its fields are checked against c_nvmlEventData_t"
}


# -- the product's pynvml uses, from its source ---------------------------------------------


@dataclass(frozen=True)
class Use:
    """One use of ``pynvml.<name>`` in the product code."""

    where: str
    line: int
    name: str
    args: tuple[ast.expr, ...] | None = None
    """Positional arguments of a call (``None``: not called here)."""
    keywords: tuple[ast.keyword, ...] = ()
    scope: ast.AST | None = None
    via_call: bool = False
    """Called through the adapter's ``self._call(op, fn, *args)``."""

    def __str__(self) -> str:
        return f"{self.where}:{self.line} {self.name}"


def _imports_pynvml(node: ast.AST) -> bool:
    return any(
        isinstance(n, ast.Call)
        and ast.unparse(n.func).endswith("import_module")
        and [ast.unparse(a) for a in n.args] == ["'pynvml'"]
        for n in ast.walk(node)
    )


def _aliases(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> set[str]:
    """Names bound to the pynvml module in a function: ``pynvml``, ``m = self._m``, a
    parameter annotated ``ModuleType``, ``... import_module("pynvml")``."""
    names = {"pynvml"}
    a = fn.args
    for arg in a.posonlyargs + a.args + a.kwonlyargs:
        if arg.annotation is not None and "ModuleType" in ast.unparse(arg.annotation):
            names.add(arg.arg)
    for n in ast.walk(fn):
        if isinstance(n, ast.Assign) and (
            ast.unparse(n.value) == "self._m" or _imports_pynvml(n.value)
        ):
            names |= {t.id for t in n.targets if isinstance(t, ast.Name)}
    return names


def _is_module(expr: ast.expr, aliases: set[str]) -> bool:
    return (isinstance(expr, ast.Name) and expr.id in aliases) or ast.unparse(expr) == "self._m"


_NAME_LITERAL = re.compile(r"^(nvml|NVML_|c_nvml)\w+$")


@functools.cache
def sources() -> dict[str, ast.Module]:
    out: dict[str, ast.Module] = {}
    for d in ("node_agent", "gpuslice"):
        for f in sorted((ROOT / d).rglob("*.py")):
            text = f.read_text()
            if "pynvml" in text:
                out[f.relative_to(ROOT).as_posix()] = ast.parse(text)
    return out


@functools.cache
def uses() -> tuple[Use, ...]:
    found: dict[tuple[str, int, int], Use] = {}
    for where, tree in sources().items():
        funcs = [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)]
        for fn in funcs:
            aliases = _aliases(fn)
            called = {
                id(n.func): n
                for n in ast.walk(fn)
                if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
            }
            for n in ast.walk(fn):
                key = (where, getattr(n, "lineno", 0), getattr(n, "col_offset", 0))
                if isinstance(n, ast.Attribute) and _is_module(n.value, aliases):
                    call = called.get(id(n))
                    found.setdefault(
                        key,
                        Use(
                            where,
                            n.lineno,
                            n.attr,
                            None if call is None else tuple(call.args),
                            () if call is None else tuple(call.keywords),
                            fn,
                        ),
                    )
                elif isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute):
                    if n.func.attr == "_call" and len(n.args) >= 2:
                        target = n.args[1]
                        if isinstance(target, ast.Attribute) and _is_module(target.value, aliases):
                            k = (where, target.lineno, target.col_offset)
                            found[k] = Use(
                                where,
                                target.lineno,
                                target.attr,
                                tuple(n.args[2:]),
                                tuple(n.keywords),
                                fn,
                                via_call=True,
                            )
                elif (
                    isinstance(n, ast.Call)
                    and ast.unparse(n.func) == "getattr"
                    and len(n.args) >= 2
                    and _is_module(n.args[0], aliases)
                    and isinstance(n.args[1], ast.Constant)
                ):
                    found.setdefault(key, Use(where, n.lineno, str(n.args[1].value), scope=fn))
        for n in ast.walk(tree):  # names looked up dynamically, e.g. _CI_PROFILE_FOR_SLICES
            if (
                isinstance(n, ast.Constant)
                and isinstance(n.value, str)
                and _NAME_LITERAL.match(n.value)
            ):
                found.setdefault((where, n.lineno, n.col_offset), Use(where, n.lineno, n.value))
    return tuple(found.values())


def calls() -> list[Use]:
    """Calls of pynvml functions (struct constructions, ``m.c_nvml..._t()``, are not here)."""
    return [
        u
        for u in uses()
        if u.args is not None and not isinstance(getattr(pynvml, u.name, None), type)
    ]


def constructions() -> list[Use]:
    return [
        u for u in uses() if u.args is not None and isinstance(getattr(pynvml, u.name, None), type)
    ]


def _bind(sig: inspect.Signature, u: Use) -> inspect.BoundArguments:
    assert u.args is not None
    if any(isinstance(a, ast.Starred) for a in u.args) or any(k.arg is None for k in u.keywords):
        raise AssertionError(f"{u}: *args/**kwargs at a call site cannot be checked")
    return sig.bind(*u.args, **{str(k.arg): k.value for k in u.keywords})


# -- what the binding does, from its source -------------------------------------------------


def _tree(fn: Any) -> ast.FunctionDef:
    node = ast.parse(textwrap.dedent(inspect.getsource(inspect.unwrap(fn)))).body[0]
    assert isinstance(node, ast.FunctionDef)
    return node


def _flatten(body: list[ast.stmt], version: Any) -> list[ast.stmt]:
    """The statements run for ``version``: an ``if`` on ``version`` replaced by its branch."""
    out: list[ast.stmt] = []
    for st in body:
        if isinstance(st, ast.If) and "version" in ast.unparse(st.test):
            taken = eval(compile(ast.Expression(st.test), "<pynvml>", "eval"), {"version": version})
            out += _flatten(st.body if taken else st.orelse, version)
        else:
            out.append(st)
    return out


def _binding_class(name: str) -> type | None:
    cls = getattr(pynvml, name, None)
    return (
        cls
        if isinstance(cls, type) and issubclass(cls, ctypes.Structure | ctypes._Pointer)
        else None
    )  # type: ignore[arg-type]


@dataclass(frozen=True)
class Returns:
    kind: str
    """``str``, ``int``, ``list``, ``struct``, ``friendly`` (a list of ``nvmlFriendlyObject`` of
    ``cls``), ``handle`` or ``other`` (``NVML_SUCCESS`` / ``None``)."""
    cls: type | None = None


def returns(name: str, version: Any = inspect.Parameter.empty) -> Returns:
    """What ``pynvml.<name>`` returns, read from its source (delegations followed)."""
    fn = getattr(pynvml, name)
    if fn.__code__.co_qualname.startswith("convertStrBytes"):
        return Returns("str")
    tree = _tree(fn)
    if version is inspect.Parameter.empty:
        p = inspect.signature(inspect.unwrap(fn)).parameters.get("version")
        version = None if p is None else p.default
    body = _flatten(tree.body, version)
    rets = [n for st in body for n in ast.walk(st) if isinstance(n, ast.Return)]
    for r in rets:
        v = r.value
        if (
            isinstance(v, ast.Call)
            and isinstance(v.func, ast.Name)
            and v.func.id.startswith("nvml")
        ):
            return returns(v.func.id)  # delegation: return nvmlX_v2(...)
    assigned: dict[str, ast.expr] = {}
    for st in body:
        for n in ast.walk(st):
            if isinstance(n, ast.Assign):
                for t in n.targets:
                    if isinstance(t, ast.Name):
                        assigned.setdefault(t.id, n.value)
    for r in rets:
        v = r.value
        if isinstance(v, ast.Name) and v.id in assigned:
            value = assigned[v.id]
            if isinstance(value, ast.Call) and isinstance(value.func, ast.Name):
                cls = _binding_class(value.func.id)
                if cls is not None:
                    return Returns("handle" if issubclass(cls, ctypes._Pointer) else "struct", cls)
            if isinstance(value, ast.List):
                structs = {
                    c
                    for st in body
                    for n in ast.walk(st)
                    if isinstance(n, ast.Name)
                    and (c := _binding_class(n.id)) is not None
                    and issubclass(c, ctypes.Structure)
                }
                assert len(structs) == 1, f"{name}: list of which struct? {structs}"
                return Returns("friendly", structs.pop())
    for r in rets:
        if isinstance(r.value, ast.Attribute) and r.value.attr == "value":
            return Returns("int")
        if isinstance(r.value, ast.List):
            return Returns("list")
    return Returns("other")


def c_pointer_params(name: str) -> set[str]:
    """Parameters of ``pynvml.<name>`` passed unchanged to the C function that C takes as
    pointers: ``*Ref`` (arrays, counts) and ``placement``."""
    tree = _tree(getattr(pynvml, name))
    params = {a.arg for a in tree.args.args}
    verbatim = {
        a.id
        for n in ast.walk(tree)
        if isinstance(n, ast.Call) and ast.unparse(n.func) == "fn"
        for a in n.args
        if isinstance(a, ast.Name) and a.id in params
    }
    return {p for p in verbatim if p.endswith("Ref") or p == "placement"}


def _fields(cls: type) -> dict[str, Any]:
    return dict(getattr(cls, "_fields_", []))


# -- the product uses the binding's names and signatures ------------------------------------


def test_the_parser_finds_the_adapter_and_probe_calls() -> None:
    by_file = {w: {u.name for u in calls() if u.where == w} for w in (ADAPTER, PROBE)}
    assert {
        "nvmlInit",
        "nvmlDeviceCreateGpuInstanceWithPlacement",
        "nvmlDeviceGetComputeRunningProcesses",
        "nvmlEventSetWait_v2",
        "nvmlDeviceRegisterEvents",
        "nvmlGpuInstanceGetComputeInstanceProfileInfo",
    } <= by_file[ADAPTER]
    assert {"nvmlDeviceGetGpuInstancePossiblePlacements", "nvmlShutdown"} <= by_file[PROBE]
    names = {u.name for u in uses() if u.where == ADAPTER}
    assert {"NVMLError", "NVMLLibraryMismatchError", "NVML_DEVICE_MIG_ENABLE"} <= names
    assert set(_CI_PROFILE_FOR_SLICES.values()) <= names


def test_every_pynvml_name_the_product_uses_exists() -> None:
    missing = [str(u) for u in uses() if not hasattr(pynvml, u.name)]
    assert not missing, f"not in pynvml {pynvml.__file__}: {missing}"


def test_every_call_binds_to_the_real_signature() -> None:
    bad = []
    for u in calls():
        fn = getattr(pynvml, u.name)
        if not inspect.isfunction(fn):
            bad.append(f"{u}: called, but pynvml's is {type(fn).__name__}")
            continue
        try:
            _bind(inspect.signature(fn), u)
        except TypeError as e:
            bad.append(f"{u}{inspect.signature(fn)}: {e}")
    assert not bad, bad


ROLE_OF_ARGUMENT = {
    "h": "device",
    "mh": "device",
    "self._handle(gpu)": "device",
    "data.device": "device",
    "gi": "gpu instance",
    "ci": "compute instance",
    "events": "event set",
    "self._events": "event set",
}
"""What the product's handle variables hold (any other argument: no handle)."""

ROLE_OF_PREFIX = {
    "nvmlDevice": "device",
    "nvmlGpuInstance": "gpu instance",
    "nvmlComputeInstance": "compute instance",
    "nvmlEventSet": "event set",
}
"""NVML's convention: ``nvml<Object><Verb>`` takes that object's handle first (pynvml names it
``device`` even where C takes an ``nvmlGpuInstance_t``, so its names are not used for it)."""


HANDLE_PARAMS = {"handle", "device", "gpuInstance", "computeInstance", "eventSet"}


def _expected_role(name: str, index: int, param: str) -> str | None:
    if index == 0 and param in HANDLE_PARAMS:
        for prefix, role in ROLE_OF_PREFIX.items():
            if name.startswith(prefix):
                return role
    return {"eventSet": "event set", "handle": "device"}.get(param)


def test_handles_go_where_the_binding_takes_them() -> None:
    """Argument order: a handle in another position (or an int in the handle's) fails."""
    bad = []
    for u in calls():
        assert u.args is not None
        params = list(inspect.signature(getattr(pynvml, u.name)).parameters)
        for i, arg in enumerate(u.args):
            got = ROLE_OF_ARGUMENT.get(ast.unparse(arg))
            want = _expected_role(u.name, i, params[i])
            if got != want:
                bad.append(f"{u} argument {i} {ast.unparse(arg)!r}: {got}, wants {want}")
    assert not bad, bad


def _is_pointer_arg(node: ast.expr, scope: ast.AST | None) -> bool:
    if isinstance(node, ast.Call) and ast.unparse(node.func) in ("ctypes.byref", "byref"):
        return True
    if isinstance(node, ast.Name) and scope is not None:  # arr = (T * n)(): a ctypes array
        return any(
            isinstance(n, ast.Assign)
            and any(isinstance(t, ast.Name) and t.id == node.id for t in n.targets)
            and isinstance(n.value, ast.Call)
            and isinstance(n.value.func, ast.BinOp)
            and isinstance(n.value.func.op, ast.Mult)
            for n in ast.walk(scope)
        )
    return False


def test_structs_the_product_builds_are_ctypes_structs_with_those_fields() -> None:
    assert {u.name for u in constructions()} >= {"c_nvmlGpuInstancePlacement_t"}
    for u in constructions():
        cls = getattr(pynvml, u.name)
        assert issubclass(cls, ctypes.Structure), u
        assert u.args is not None and len(u.args) <= len(_fields(cls)), u
        assert {k.arg for k in u.keywords} <= _fields(cls).keys(), u
    # create_gpu_instance sets .start / .size on the placement it passes by reference
    assert list(_fields(pynvml.c_nvmlGpuInstancePlacement_t)) == ["start", "size"]


def test_pointer_arguments_are_passed_by_reference() -> None:
    """pynvml passes these straight to C: a struct by value or a bare int would be garbage."""
    assert c_pointer_params("nvmlDeviceCreateGpuInstanceWithPlacement") == {"placement"}
    assert c_pointer_params("nvmlDeviceGetGpuInstances") == {"gpuInstancesRef", "countRef"}
    bad = []
    for u in calls():
        fn = getattr(pynvml, u.name)
        wanted = c_pointer_params(u.name)
        if not wanted:
            continue
        bound = _bind(inspect.signature(fn), u).arguments
        for p in sorted(wanted & bound.keys()):
            if not _is_pointer_arg(bound[p], u.scope):
                bad.append(f"{u}: {p} = {ast.unparse(bound[p])}")
    assert not bad, f"pass ctypes.byref(...) or a ctypes array: {bad}"


def test_version_checked_functions_go_through_the_error_mapping() -> None:
    """``@throwOnVersionMismatch`` raises ``NVMLLibraryMismatchError``: only ``_call`` maps it."""
    assert not issubclass(pynvml.NVMLLibraryMismatchError, pynvml.NVMLError)
    checked = {
        n
        for n, f in vars(pynvml).items()
        if inspect.isfunction(f) and f.__code__.co_qualname.startswith("throwOnVersionMismatch")
    }
    assert "nvmlDeviceGetComputeRunningProcesses" in checked
    bad = [str(u) for u in calls() if u.name in checked and u.where == ADAPTER and not u.via_call]
    assert not bad, f"call these through self._call: {bad}"


# -- constants ------------------------------------------------------------------------------


def _binding_constants(prefix: str) -> dict[str, int]:
    return {
        n.removeprefix(prefix): v
        for n, v in vars(pynvml).items()
        if n.startswith(prefix) and isinstance(v, int)
    }


def test_error_codes_are_the_bindings_both_ways() -> None:
    assert {m.name: m.value for m in NvmlErrorCode} == _binding_constants("NVML_ERROR_")
    for m in NvmlErrorCode:
        e = pynvml.NVMLError(m.value)
        assert isinstance(e, pynvml.NVMLError) and e.value == m.value
        assert NvmlErrorCode.of(int(e.value)) is m


def test_compute_modes_and_mig_modes_are_the_bindings() -> None:
    modes = _binding_constants("NVML_COMPUTEMODE_")
    assert modes.pop("COUNT") == len(ComputeMode)
    assert {m.name: m.value for m in ComputeMode} == modes
    # FakePynvml (and FakeNvml) encode the MIG mode as int(bool)
    assert (pynvml.NVML_DEVICE_MIG_DISABLE, pynvml.NVML_DEVICE_MIG_ENABLE) == (0, 1)


def test_private_nvml_constants_equal_the_bindings() -> None:
    found = {}
    for where, tree in sources().items():
        for n in tree.body:
            if isinstance(n, ast.Assign | ast.AnnAssign) and isinstance(n.value, ast.Constant):
                targets = n.targets if isinstance(n, ast.Assign) else [n.target]
                for t in targets:
                    if isinstance(t, ast.Name) and t.id.startswith("_NVML_"):
                        found[f"{where} {t.id}"] = (t.id.removeprefix("_"), n.value.value)
    assert len(found) >= 3, found  # _NVML_SUCCESS, _NVML_ERROR_NOT_SUPPORTED, ...
    bad = {k: v for k, (name, v) in found.items() if getattr(pynvml, name, object()) != v}
    assert not bad, bad


def test_profile_constants_cover_the_binding_and_the_catalog() -> None:
    ci = {
        int(m.group(1)): n
        for n in vars(pynvml)
        if (m := re.fullmatch(r"NVML_COMPUTE_INSTANCE_PROFILE_(\d+)_SLICE", n))
    }
    assert ci == _CI_PROFILE_FOR_SLICES, "the full-size CI profile of every slice count"
    gi = _binding_constants("NVML_GPU_INSTANCE_PROFILE_")
    count = gi.pop("COUNT")
    assert set(gi.values()) == set(range(count)), "range(COUNT) enumerates every GI profile"
    catalog = default_catalog()
    for model in catalog.models:
        for p in model.profiles:
            assert gi[_gi_constant_for(p)] == p.nvml_index, (model.name, p.name, p.nvml_index)
            assert p.compute in _CI_PROFILE_FOR_SLICES, (model.name, p.name, p.compute)


def _gi_constant_for(p: MigProfile) -> str:
    """The ``NVML_GPU_INSTANCE_PROFILE_*`` suffix a profile's shape names, from nvml.h's naming:
    ``<n>_SLICE`` for the plain ``<n>g``, ``_REV1`` for its media-extension variant, ``_REV2``
    for the 1g with two memory slices (``1g.2m``), ``_GFX`` for the graphics variant,
    ``_ALL_ME`` / ``_NO_ME`` for ``+me.all`` / ``-me``."""
    suffix = {"": "", "+me": "_REV1", "+gfx": "_GFX", "+me.all": "_ALL_ME", "-me": "_NO_ME"}
    if p.shape == "1g.2m":
        return "1_SLICE_REV2"
    return f"{p.compute}_SLICE{suffix[p.variant]}"


def test_the_unscoped_event_id_fits_the_event_struct() -> None:
    assert XID_NOT_MIG_SCOPED == pynvml.NVML_GPU_INSTANCE_ID_ANY == 2**32 - 1
    assert XID_NOT_MIG_SCOPED == pynvml.NVML_COMPUTE_INSTANCE_ID_ANY
    f = _fields(pynvml.c_nvmlEventData_t)
    assert f["gpuInstanceId"] is ctypes.c_uint and f["computeInstanceId"] is ctypes.c_uint
    assert f["eventType"] is ctypes.c_ulonglong and f["device"] is pynvml.c_nvmlDevice_t
    data = pynvml.c_nvmlEventData_t()
    data.gpuInstanceId = XID_NOT_MIG_SCOPED
    data.eventType = pynvml.nvmlEventTypeXidCriticalError
    assert data.gpuInstanceId == XID_NOT_MIG_SCOPED
    assert data.eventType == pynvml.nvmlEventTypeXidCriticalError


def test_a_device_handle_keeps_its_identity_through_an_event() -> None:
    """``_handle_key`` of the handle registered equals that of ``nvmlEventData_t.device``."""
    h = ctypes.cast(ctypes.c_void_p(0x7F00_1234), pynvml.c_nvmlDevice_t)
    data = pynvml.c_nvmlEventData_t()
    data.device = h
    assert _handle_key(h) == _handle_key(data.device) == 0x7F00_1234
    assert _handle_key(pynvml.c_nvmlDevice_t()) is None
    assert _handle_key(("gpu", 0)) == ("gpu", 0)  # the fakes' handles stay hashable


# -- struct fields --------------------------------------------------------------------------


def test_the_fields_read_exist_on_the_structs_the_binding_returns() -> None:
    bad = []
    called = {u.name for u in calls()}
    assert READS.keys() <= called, f"stale READS entries: {READS.keys() - called}"
    for u in calls():
        if u.name not in READS:
            continue
        bound = _bind(inspect.signature(getattr(pynvml, u.name)), u).arguments
        v = bound.get("version")
        version = ast.literal_eval(v) if v is not None else inspect.Parameter.empty
        r = returns(u.name, version)
        if r.kind not in ("struct", "friendly") or r.cls is None:
            bad.append(f"{u}: returns {r.kind}, not a struct")
            continue
        missing = READS[u.name] - _fields(r.cls).keys()
        if missing:
            bad.append(f"{u}: {r.cls.__name__} has no {sorted(missing)}")
    placement = _fields(pynvml.c_nvmlGpuInstancePlacement_t)
    assert {"start", "size"} <= placement.keys()
    assert _fields(pynvml.c_nvmlGpuInstanceInfo_t)["placement"] is (
        pynvml.c_nvmlGpuInstancePlacement_t
    )
    assert not bad, bad


def test_every_camel_case_attribute_read_is_a_known_struct_field() -> None:
    """A misspelt field (``pciDeviceID``, ``gpuInstanceID``) is caught even outside ``READS``."""
    known = set().union(*READS.values()) | {"start", "size"}
    read = {
        f"{where}:{n.lineno} .{n.attr}": n.attr
        for where in (ADAPTER, PROBE)
        for n in ast.walk(sources()[where])
        if isinstance(n, ast.Attribute)
        and re.fullmatch(r"[a-z]+[A-Z]\w*", n.attr)
        and not _is_module(n.value, {"m", "pynvml", "logging"})
    }
    assert "pciDeviceId" in read.values()
    assert not {k for k, a in read.items() if a not in known}


# -- the fakes ------------------------------------------------------------------------------


def _fake_for(where: str) -> Any:
    nv = FakeNvml([default_catalog().model("A100-SXM4-80GB")])
    return {ADAPTER: EventPynvml(nv), PROBE: FakeDriver()}[where]


def _required(sig: inspect.Signature) -> int:
    return sum(
        p.default is p.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
        for p in sig.parameters.values()
    )


@pytest.mark.parametrize("where", [ADAPTER, PROBE])
def test_the_fakes_expose_the_bindings_names_and_signatures(where: str) -> None:
    fake = _fake_for(where)
    bad = []
    for u in uses():
        if u.where != where:
            continue
        real = getattr(pynvml, u.name)
        try:
            mine = inspect.getattr_static(fake, u.name)
        except AttributeError:
            bad.append(f"{u}: the fake lacks it")
            continue
        if inspect.isfunction(real):
            if not inspect.isfunction(mine):
                bad.append(f"{u}: the fake's is no function")
                continue
            sig = inspect.signature(getattr(fake, u.name))  # bound: without self
            if _required(sig) != _required(inspect.signature(real)):
                bad.append(f"{u}: fake{sig} vs pynvml{inspect.signature(real)}")
            if u.args is not None:
                try:
                    _bind(sig, u)
                except TypeError as e:
                    bad.append(f"{u}: the fake does not take the call: {e}")
        elif isinstance(real, type) and issubclass(real, ctypes._Pointer):
            # opaque handles: the fake's are its own objects, in ctypes arrays all the same
            assert isinstance(mine, type) and issubclass(
                mine, ctypes._SimpleCData | ctypes._Pointer
            )  # type: ignore[arg-type]
        elif mine is not real and mine != real:
            bad.append(f"{u}: fake {mine!r} != pynvml {real!r}")
    assert not bad, bad


@pytest.mark.parametrize("fake", [FakePynvml, EventPynvml, FakeDriver])
def test_the_fakes_define_no_function_the_binding_lacks(fake: type) -> None:
    bad = []
    for cls in fake.__mro__:
        for name, f in vars(cls).items():
            if not (name.startswith("nvml") and inspect.isfunction(f)):
                continue
            real = getattr(pynvml, name, None)
            if real is None:
                bad.append(f"{cls.__name__}.{name}: no such pynvml function")
            elif _required(inspect.signature(f)) - 1 != _required(inspect.signature(real)):
                bad.append(
                    f"{cls.__name__}.{name}{inspect.signature(f)} vs {inspect.signature(real)}"
                )
    assert not bad, bad


class Recorder:
    """A pynvml module that records what each ``nvml*`` function returned."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.returned: dict[str, list[Any]] = {}

    def __getattr__(self, name: str) -> Any:
        value = getattr(self.inner, name)
        if not (name.startswith("nvml") and callable(value)):
            return value

        def recorded(*args: Any, **kwargs: Any) -> Any:
            out = value(*args, **kwargs)
            self.returned.setdefault(name, []).append(out)
            return out

        return recorded


def test_the_fake_returns_what_the_binding_returns() -> None:
    cat = default_catalog()
    a100 = cat.model("A100-SXM4-80GB")
    nv = FakeNvml([a100, a100], mig_enabled=True)
    inner = EventPynvml(nv)
    mod = Recorder(inner)
    ad = PynvmlAdapter(mod, NvidiaSmi(nv.nvidia_smi))  # type: ignore[arg-type]
    ad.gpus()
    gi = ad.create_gpu_instance(0, a100.profile("3g.40gb").profile_id, 0, 4)
    ci = ad.create_compute_instance(0, gi)
    assert [g.gi_id for g in ad.gpu_instances(0)] == [gi] and len(ad.mig_devices(0)) == 1
    pid = nv.start_process(0, gi, ci, name="python3")
    assert ad.running_processes(0, gi) == [pid] and ad.process_name(pid) == "python3"
    nv.stop_process(pid)
    ad.destroy_compute_instance(0, gi, ci)
    ad.destroy_gpu_instance(0, gi)
    ad.set_mig_mode(1, False)
    ad.reset_gpu(1)
    inner.unsupported.add(1)  # GPU 1 unregistered: its event is named by nvmlDeviceGetIndex
    ad.watch_xids()
    inner.waits = [(1, 79, XID_NOT_MIG_SCOPED, XID_NOT_MIG_SCOPED)]
    assert [e.gpu for e in ad.xid_events(10)] == [1]
    ad.close()

    bad = []
    for name, outs in mod.returned.items():
        r = returns(name)
        if name in RETURN_NOT_CHECKED or r.kind in ("handle", "other"):
            continue
        for out in outs:
            if r.kind == "str":
                ok = isinstance(out, str)
            elif r.kind == "int":
                ok = isinstance(out, int) and not isinstance(out, bool)
            elif r.kind == "list":
                ok = isinstance(out, list) and all(isinstance(x, int) for x in out)
            elif r.kind == "struct":
                ok = type(out) is r.cls
            else:  # friendly
                assert r.cls is not None
                ok = isinstance(out, list) and all(
                    isinstance(x, pynvml.nvmlFriendlyObject)
                    and vars(x).keys() == _fields(r.cls).keys()
                    for x in out
                )
            if not ok:
                bad.append(f"{name} -> {out!r}; pynvml returns {r.kind} {r.cls or ''}")
    assert not bad, bad
    checkable = {
        u.name
        for u in calls()
        if u.where == ADAPTER and returns(u.name).kind not in ("handle", "other")
    }
    assert RETURN_NOT_CHECKED.keys() <= checkable
    unexercised = checkable - mod.returned.keys() - RETURN_NOT_CHECKED.keys()
    assert not unexercised, f"extend this scenario to call {unexercised}"
