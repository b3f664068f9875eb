"""How a GPU model activates a MIG-mode change: after a GPU reset (Ampere) or at once (Hopper+).

Model
-----
Enabling or disabling MIG mode needs the whole GPU idle (facts/mig.md).  What happens next
depends on the GPU family:

* **Ampere** (the GA100 die: A100, A30, A800): ``nvmlDeviceSetMigMode`` records the new mode as
  *pending* (``nvmlDeviceGetMigMode`` returns ``[current, pending]`` with ``pending !=
  current``); it becomes current at the next GPU reset (``nvidia-smi -r -i <idx>``) or node
  reboot, and from then on it *persists* across reboots.
* **Hopper and later** (H100, H200, GH200, H20, B200, GB200, RTX PRO Blackwell): the change is
  immediate (no reset) and is *not* persistent: a reboot or driver reload brings MIG mode back
  to disabled.

The family is known from the PCI device id, which NVML reports for every GPU and the catalog
lists for every model: GA100 parts have device ids ``0x20B0``-``0x20FF`` (``20B0``/``20B1``/
``20F1`` A100-40GB, ``20B2``/``20B5`` A100-80GB, ``20B7`` A30, ``20F3``/``20F5``/``20F6``
A800); every other MIG-capable id is treated as resetless.  A catalog override that adds an
Ampere board under a new name is therefore classified without another table to maintain.

Only the fake NVML needs this table (to behave like the board it models); the reconciler never
asks for the family: it reads the pending mode from NVML and resets whenever a change is
pending, so it is right on boards this table has not heard of.
"""

from __future__ import annotations

from enum import Enum

from planner.catalog import GpuModel

__all__ = ["GA100_PCI_IDS", "MigActivation", "mig_activation", "pci_id_needs_reset"]

GA100_PCI_IDS = range(0x20B0, 0x2100)
"""PCI device ids of the GA100 die (A100, A30, A800): MIG-mode changes wait for a reset."""


class MigActivation(Enum):
    """When a requested MIG-mode change takes effect."""

    RESET = "reset"
    """Pending until a GPU reset or reboot; persistent across reboots (Ampere)."""
    IMMEDIATE = "immediate"
    """At once; lost on reboot or driver reload (Hopper and later)."""


def pci_id_needs_reset(pci_device_id: str) -> bool:
    """True iff the PCI device id (four hex digits, e.g. ``20B2``) is an Ampere GA100 part."""
    try:
        value = int(pci_device_id, 16)
    except ValueError:
        raise ValueError(
            f"PCI device id {pci_device_id!r} is not hexadecimal; give four hex digits such as "
            "'20B2' (nvidia.com/gpu.product / lspci -nn)"
        ) from None
    return value in GA100_PCI_IDS


def mig_activation(model: GpuModel) -> MigActivation:
    """The activation behaviour of a catalog model (see the module docstring)."""
    if any(pci_id_needs_reset(p) for p in model.pci_device_ids):
        return MigActivation.RESET
    return MigActivation.IMMEDIATE
