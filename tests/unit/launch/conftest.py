"""The Hub stand-in (tests/hub_standin.py) for huggingface_hub's real client, on a free local port."""

from __future__ import annotations

import pytest
from hub_standin import serve


@pytest.fixture
def hub(monkeypatch):
    server, state = serve()
    endpoint = f"http://127.0.0.1:{server.server_port}"
    monkeypatch.setattr("huggingface_hub.constants.ENDPOINT", endpoint)  # HF_ENDPOINT, as read at import
    monkeypatch.setattr("huggingface_hub.constants.HUGGINGFACE_CO_URL_TEMPLATE",
                        endpoint + "/{repo_id}/resolve/{revision}/{filename}")
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_DISABLE_XET", True)  # see hub_standin's docstring
    monkeypatch.setenv("HF_TOKEN", "hf_test")
    yield state
    server.shutdown()
    server.server_close()
