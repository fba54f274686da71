"""The HTTP API's /health says what the gRPC health service says (issue 69: it answered ok
while gRPC health was NOT_SERVING, so an HTTP probe kept sending to a coordinator with no
target)."""

from __future__ import annotations

import json
from typing import Any, cast

import pytest

from coordinator.openai_api import OpenAIApi


@pytest.mark.parametrize("serving, status, body", [(True, 200, "ok"), (False, 503, "unavailable")])
async def test_health_follows_the_coordinators_serving_state(serving, status, body):
    api = OpenAIApi(cast(Any, None), "m", serving=lambda: serving)
    response = await api.health(cast(Any, None))
    assert response.status == status
    assert json.loads(cast(bytes, response.body))["status"] == body
