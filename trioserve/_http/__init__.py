"""The HTTP surface: an ASGI app for hypercorn's trio worker.

* ``_generation.py`` — ``POST /v1/completions`` and ``/v1/chat/completions``, served at
  the ASGI level so each request's whole life is one cancel scope (the module
  docstring there draws it);
* ``_routes.py`` — everything else, as an ordinary quart-trio app (health, models,
  metrics, the page, JSON errors for unknown paths);
* ``_exchange.py`` — one exchange's response side and request helpers;
* ``_state.py`` — settings, shared server state, per-request cancel handles.
"""

from ._generation import FINAL_EVENT_TIMEOUT
from ._request import InFlightRequest, Phase
from ._routes import create_app
from ._state import HTTPSettings, ServerState

__all__ = ["FINAL_EVENT_TIMEOUT", "HTTPSettings", "InFlightRequest", "Phase", "ServerState", "create_app"]
