"""Where the tests find the Alibaba openb traces (``../shared/traces/openb``, beside the
checkout), and the marker that skips a test when they are not there."""

from __future__ import annotations

from pathlib import Path

import pytest

OPENB = Path(__file__).resolve().parents[2] / "shared" / "traces" / "openb"
needs_openb = pytest.mark.skipif(
    not (OPENB / "openb_pod_list_default.csv").is_file(),
    reason=f"openb traces not found at {OPENB} (../shared/traces/openb)",
)
