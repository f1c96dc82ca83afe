"""The registry's names, changed while it serves: a model added (Ollama's
``/api/create``), a second name for a model (``/api/copy``), a name taken away
(``/api/delete``) — and, with a model's last name, the model itself: unloaded as an
explicit unload is (running streams get the grace period), then forgotten. Nothing here
touches a file (docs/models.md, "Ollama's model routes")."""

from __future__ import annotations

import dataclasses
import logging

from .._exceptions import InvalidRequestError
from ._entry import ModelEntry
from ._leasing import _Leasing
from ._spec import ModelSpec

logger = logging.getLogger("trioserve.models")


class _Catalog(_Leasing):
    """:meth:`add`, :meth:`add_alias` and :meth:`remove_name`."""

    def add(self, spec: ModelSpec) -> ModelEntry:
        """Serve one more model (loaded on demand, as the others). Raises
        :class:`InvalidRequestError` (code ``model_exists``) if one of its names is
        taken."""
        for name in (spec.name, *spec.aliases):
            if not name or name in self._by_name:
                raise InvalidRequestError(
                    f"a model named {name!r} exists already; delete it first or choose another name",
                    param="model",
                    code="model_exists",
                )
        entry = ModelEntry(spec)
        self.entries.append(entry)
        for name in entry.names:
            self._by_name[name] = entry
        logger.info("model %s: added (%s)", spec.name, spec.source.description)
        self._notify()
        return entry

    def add_alias(self, name: str, alias: str) -> ModelEntry:
        """``alias`` names ``name``'s model too (nothing is loaded or copied). A name it
        already has: nothing changes. Raises :class:`NotFoundError` for an unknown
        ``name``, :class:`InvalidRequestError` (``model_exists``) when ``alias`` names
        another model."""
        entry = self.resolve(name)
        taken = self._by_name.get(alias)
        if taken is entry:
            return entry
        if taken is not None:
            raise InvalidRequestError(
                f"{alias!r} names another model ({taken.name!r}); delete it first or choose another name",
                param="destination",
                code="model_exists",
            )
        entry.spec = dataclasses.replace(entry.spec, aliases=(*entry.spec.aliases, alias))
        self._by_name[alias] = entry
        self._notify()
        return entry

    async def remove_name(self, name: str, *, grace: float | None = None) -> tuple[ModelEntry, bool]:
        """Take ``name`` away: ``(its model, whether the model went with it)``. A model
        keeps its other names (its first alias becomes its name if ``name`` was it);
        with its last name it is unloaded — new requests for it get 404 at once,
        running streams get ``grace`` seconds (default: ``unload_grace``) and then end
        with cause ``unload`` — and forgotten. Its file is not touched.

        Raises:
            NotFoundError: no model has that name.
            InvalidRequestError: (``model_pinned``) it is the last name of a pinned
                model (the single-model server's among them), or of the only model.

        Cancellation: as :meth:`unload`: once begun, the unload goes on (shielded)."""
        entry = self.resolve(name)
        spec = entry.spec
        names = [n for n in entry.names if n]
        if len(names) > 1:
            rest = [n for n in names if n != name]
            entry.spec = dataclasses.replace(spec, name=rest[0], aliases=tuple(rest[1:]))
            del self._by_name[name]
            self._notify()
            return entry, False
        if spec.pinned or len(self.entries) == 1:
            why = "it is this server's only model" if len(self.entries) == 1 else "it is pinned"
            raise InvalidRequestError(
                f"the model {name!r} cannot be deleted: {why}; stop the server instead",
                param="model",
                code="model_pinned",
            )
        del self._by_name[name]
        entry.removed = True
        self._notify()
        await self.unload(entry, grace=grace)
        if entry in self.entries:
            self.entries.remove(entry)
        logger.info("model %s: deleted (its file is kept: %s)", name, spec.source.description)
        self._notify()
        return entry, True
