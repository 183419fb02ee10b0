"""Every test here needs network namespaces: skip them all, with the reason, where none can be made."""

from __future__ import annotations

import pytest

from tests.multihost.netns import skip_reason


@pytest.fixture(autouse=True)
def _need_namespaces() -> None:
    reason = skip_reason()
    if reason is not None:
        pytest.skip(reason)
