"""When torchrun's restarts could start on stale addresses: several machines, its shared store, restarts."""

from __future__ import annotations

import pytest

from rewrite.run.stores import restart_hazard

SHARED = {"GROUP_WORLD_SIZE": "2", "TORCHELASTIC_MAX_RESTARTS": "1", "TORCHELASTIC_USE_AGENT_STORE": "True"}


@pytest.mark.parametrize("env, hazard", [
    (SHARED, True),
    ({**SHARED, "GROUP_WORLD_SIZE": "1"}, False),  # one machine: its agent's count is every worker's
    ({**SHARED, "TORCHELASTIC_MAX_RESTARTS": "0"}, False),  # no restart
    ({**SHARED, "TORCHELASTIC_USE_AGENT_STORE": "False"}, False),  # TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1
    ({}, False),  # not under torchrun
])
def test_restart_hazard(monkeypatch, env, hazard):
    for key in SHARED:
        monkeypatch.delenv(key, raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    said = restart_hazard()
    assert (said is not None) == hazard
    if hazard:
        assert "set TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 for torchrun on every machine" in said
