"""The HTTP surface: an ASGI app for hypercorn's trio worker, and the server around it.

The generation endpoints are served at the ASGI level (:mod:`._generation`: one request,
one cancel scope), everything else by a quart-trio app (:mod:`._routes`); every error
response is rendered by :mod:`._errors`. Imports :mod:`trioserve._core` and
:mod:`trioserve._wire`, never :mod:`trioserve._backends`. Module map:
``docs/architecture.md``.
"""

from ._generation import FINAL_EVENT_TIMEOUT
from ._request import InFlightRequest, Phase
from ._routes import create_app
from ._settings import HTTPSettings
from ._state import ServerState

__all__ = ["FINAL_EVENT_TIMEOUT", "HTTPSettings", "InFlightRequest", "Phase", "ServerState", "create_app"]
