"""Which restarted workers set their process group up on their own attempt's keys (the restart itself runs with
real processes in tests/equivalence/test_sharded.py)."""

from __future__ import annotations

import pytest

from anyfit.hardware.elastic import restarted_attempt

AGENT = {"TORCHELASTIC_USE_AGENT_STORE": "True", "GROUP_WORLD_SIZE": "1"}


@pytest.mark.parametrize("environ, attempt", [
    ({}, 0),  # not launched by torchrun
    ({**AGENT, "TORCHELASTIC_RESTART_COUNT": "0"}, 0),  # the first attempt: PyTorch's own keys are fresh
    ({**AGENT, "TORCHELASTIC_RESTART_COUNT": "2"}, 2),
    ({**AGENT, "TORCHELASTIC_RESTART_COUNT": "2", "GROUP_WORLD_SIZE": "3"}, 0),  # several machines: counts differ
    ({**AGENT, "TORCHELASTIC_RESTART_COUNT": "1", "TORCHELASTIC_USE_AGENT_STORE": "False"}, 0),
])
def test_only_a_restarted_one_machine_job_on_the_agents_store(environ, attempt):
    assert restarted_attempt(environ) == attempt
