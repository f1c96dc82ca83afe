"""The generation requests no connection holds: a detachable stream
(``X-Conversation-Id``, docs/resumable-streams.md), whose job writes into its stream's log
and whose ``POST`` is its first reader, and a background response (``background: true``,
docs/dialects.md, "Stored responses"), run in the store's nursery and its end stored.
Both run the same :meth:`RequestScope._run` as a request with a connection."""

import dataclasses
import logging
import uuid

import trio

from .._core._errors import unwrap_group
from .._core._exceptions import InvalidRequestError, ServiceUnavailableError, TrioserveError
from .._core._tracing import TRACEPARENT
from .._wire import StoredAsk, encode_json, responses_reply
from ._accounting import log_request
from ._detach import DetachController, DetachedStream, log_sink
from ._errors import renderer
from ._event_store import EventRecorder
from ._exchange import Exchange, Receive
from ._following import follow
from ._lifecycle import INLINE_PARSE_BYTES, off_the_loop_if
from ._request import InFlightRequest, Phase
from ._request_scope import RequestScope, RunPlan
from ._stored import BackgroundJob

__all__ = ["DetachedJobs"]

logger = logging.getLogger("trioserve.http")


async def _nowhere(_message: object) -> None:
    """The ``send`` of a background response: no connection holds it."""


async def _never_disconnects() -> dict[str, object]:
    """The ``receive`` of a background response: nobody leaves (cancel it by id)."""
    await trio.sleep_forever()
    raise AssertionError("unreachable")


class DetachedJobs(RequestScope):
    """Starts and runs the jobs that outlive their connection (or never had one)."""

    async def _start_detached(
        self, request: InFlightRequest, receive: Receive, plan: RunPlan, conversation: str
    ) -> None:
        """A detachable stream (docs/resumable-streams.md): its job starts in the
        detached streams' nursery, writing into the stream's log; this request's
        connection becomes its first reader. Its end (a disconnect, a stall) ends the
        reading, never the job."""
        detached = self.state.detached
        assert detached is not None
        stream = detached.open(request.owner, conversation, request.account)
        exchange = Exchange(log_sink(stream.log), request.exchange.request_id, request.exchange.render)
        # (the key's x-ratelimit-* go out on the reader's own exchange, once)
        exchange.extra_headers = [(b"x-conversation-id", conversation.encode())]
        job = InFlightRequest(request.asgi, exchange, request.kind)
        job.owner, job.account, job.session = request.owner, request.account, request.session
        job.model = request.model
        job.cancel_scope.deadline = request.cancel_scope.deadline
        stream.job = job
        request.model = plan.entry.name
        await self._detach(request, receive, stream, plan)

    async def _detach(
        self,
        request: InFlightRequest,
        receive: Receive,
        stream: DetachedStream,
        plan: RunPlan,
        background: BackgroundJob | None = None,
    ) -> None:
        """Start ``stream``'s job in the detached streams' nursery; ``request``'s
        connection follows its log, its first reader."""
        detached = self.state.detached
        assert detached is not None
        assert stream.job is not None
        cursor = stream.log.attach(0)
        detached.nursery.start_soon(self._detached_job, stream, plan, background)
        await follow(
            request,
            stream.log,
            cursor,
            receive,
            stall_timeout=self.state.stall_timeout,
            job_id=stream.job.exchange.request_id,
        )

    async def _detached_job(
        self, stream: DetachedStream, plan: RunPlan, background: BackgroundJob | None
    ) -> None:
        """A detachable stream's job, to its end (a background response's: its end
        stored); then its log is kept for readers."""
        detached = self.state.detached
        assert detached is not None
        job = stream.job
        assert job is not None
        log = stream.log
        service = self.state.responses
        recorder = None
        if background is not None and service is not None:
            # (its events kept in the store as they come, in batches: _event_store)
            recorder = EventRecorder(service, background.turn.id, background.owner)
            log.on_event = recorder.add

        async def serve() -> None:
            with unwrap_group():
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(DetachController(detached, stream).run)
                    if recorder is not None:
                        nursery.start_soon(recorder.run)
                    try:
                        await self._run(job, _never_disconnects, plan, detached=True)
                    finally:
                        nursery.cancel_scope.cancel()

        try:
            await self._handle(job, serve)
        except Exception:
            logger.exception("detached stream %s failed", job.exchange.request_id)
        finally:
            with trio.CancelScope(shield=True):
                if recorder is not None:
                    log.on_event = None
                    await recorder.close()  # (its last events, before its end is stored)
                if background is not None and service is not None:
                    await service.settle(background)
                    background.done.set()
            if not log.closed:  # (readers wait for the end: it is always written)
                if not log.head_set.is_set():
                    log.set_head(500, [])
                if not log.finished:
                    log.append_nowait(b"", last=True)
        await detached.keep(stream)

    async def _start_background(self, request: InFlightRequest, receive: Receive, plan: RunPlan) -> None:
        """A background response: checked, stored as ``queued`` and started as a
        request no connection holds. Without ``stream`` (in the store's nursery) this
        request answers with the queued response object at once (docs/dialects.md,
        "Stored responses"); with it, its job writes into a detachable stream keyed by
        the response id, and this request's connection is its first reader
        (docs/resumable-streams.md)."""
        service = self.state.responses
        assert service is not None
        ask = plan.ask
        assert ask is not None
        detached = self.state.detached if ask.stream else None
        if ask.stream and detached is None:
            raise InvalidRequestError(
                "background with stream needs resumable streams, and this server keeps none "
                "(--detach-max 0): poll GET /v1/responses/{id}, or send stream without background",
                param="stream",
            )
        owner = self.owner(request.asgi)
        response_id = "resp_" + uuid.uuid4().hex
        stored = await service.context(ask.previous_response_id, owner, response_id)
        options = self._options(stored)
        large = len(plan.body) > INLINE_PARSE_BYTES
        turn, queued = await off_the_loop_if(large, responses_reply, plan.body, options)
        # (its bounds: a 429 before anything is stored)
        account = request.account
        stream = None if detached is None else detached.open(owner, response_id, account, param="stream")
        # its own request: its own scope, deadline and log line; nothing to send to,
        # or its stream's log
        send = _nowhere if stream is None else log_sink(stream.log)
        exchange = Exchange(send, response_id, renderer(plan.spec))
        job_request = InFlightRequest(request.asgi, exchange, "responses")
        job_request.owner = owner
        job_request.account = request.account  # (its limits were taken by this request)
        if stream is None:
            self.state.tracing.begin(job_request, "/v1/responses")
        job_request.model = plan.entry.name
        job_request.cancel_scope.deadline = request.cancel_scope.deadline
        job = BackgroundJob(turn, owner, queued, job_request)
        if not await service.record(turn, owner, queued, streamed=stream is not None):
            if stream is not None and detached is not None:
                detached.drop(stream)
            # nothing could be polled: refused before any generation (the log says why)
            raise ServiceUnavailableError(
                "the response store cannot keep a background response now (see /health); "
                "retry later, or send it without background",
                code="store_unavailable",
            )
        service.jobs[response_id] = job
        if stream is not None:
            stream.background = True
            stream.job = job_request
            request.model = plan.entry.name
            ask = StoredAsk(turn.previous_id, background=True, stream=True)
            await self._detach(request, receive, stream, dataclasses.replace(plan, ask=ask), job)
            return
        service.nursery.start_soon(self._background, job, plan)
        request.end("stop")
        request.delivered = True
        request.watch_scope.cancel()
        await request.exchange.json(200, encode_json(queued))

    async def _background(self, job: BackgroundJob, plan: RunPlan) -> None:
        """Run a background response to its end, then store how it ended. Never raises
        into the server's nursery but to stop (a bug is logged and stored as a failure)."""
        service = self.state.responses
        assert service is not None
        assert job.request is not None
        request = job.request
        TRACEPARENT.set(request.traceparent)  # (this task's own context: the job's trace)
        try:
            ask = StoredAsk(job.turn.previous_id, background=True)
            await self._run(request, _never_disconnects, dataclasses.replace(plan, ask=ask))
        except TrioserveError as exc:
            request.end(request.cause or "error", exc.message)
        except Exception as exc:
            logger.exception("background response %s failed", job.turn.id)
            request.end("error", f"{type(exc).__name__}: {exc}")
        except BaseException:  # cancelled from outside its scope: the server is stopping
            if request.cause is None:
                request.end("shutdown")
            raise
        finally:
            request.advance(Phase.DONE)
            with trio.CancelScope(shield=True):
                # (a store, log or export failure is logged: never the server's nursery's)
                await service.settle(job)
                try:
                    usage = log_request(self.state.metrics, request)
                    account = request.account
                    if usage is not None and account is not None:
                        # its reply, against its key's tokens per minute (its prompt
                        # was charged when prepared), as in the foreground
                        self.state.accounts.charge(request.owner, account, usage.completion_tokens)
                    self.state.tracing.end(request, usage)
                except Exception:
                    logger.exception("background response %s: its log line failed", job.turn.id)
                request.done.set()
                job.done.set()
