"""Who is in a job, for the reducer's state machine: a worker's connection joining (one live
client per rank, a reconnect keeping its rank's place), leaving (for a while, within its rejoin
grace, or for good), and what a rank gone for good takes with it (the open chunks that needed it,
the results kept for it, the job itself once nobody is left).

:class:`_MembershipRules` is a base class of ``ReducerCore`` (``reducer.py``), kept apart so that
these rules read in one place.
"""

from __future__ import annotations

from .reducer_actions import Action, CloseConnection, Log, SendError
from .reducer_chunks import _CutThroughChunk, _OpenChunk
from .reducer_jobs import JobParams, _Conn, _Job, _Member
from .reducer_results import _ResultRules
from .wire import Error, ErrorCode, Hello, StragglerMode

__all__: list[str] = []


class _MembershipRules(_ResultRules):
    """Joining and leaving, for ``ReducerCore``."""

    rejoin_grace: float  # the longest a rank's place is kept for its reconnect

    def join(self, conn: int, hello: Hello, *, peer: str = "?", now: float = 0.0) -> list[Action]:
        """A worker connection completed its handshake. Returns errors if it cannot join.

        One live client per (job, rank) (R23): a connection of another session for a rank
        whose client is still connected is refused, naming both peers. The same session
        joining again is that client reconnecting (R22): the rank keeps its place, and what it
        resends is matched with what the reducer already has."""
        params = JobParams.from_hello(hello)
        job = self._jobs.get(hello.job)
        if job is None:
            job = self._jobs[hello.job] = _Job(hello.job, params)
        elif job.params != params:
            diffs = [
                f"{name}: job has {getattr(job.params, name)}, rank {hello.rank} sent {getattr(params, name)}"
                for name in ("world_size", "mode", "min_contributors", "deadline_ms", "op_timeout_ms")
                if getattr(job.params, name) != getattr(params, name)
            ]
            message = f"job {hello.job!r} parameters differ: " + "; ".join(diffs)
            if not job.members:
                job.params = params  # nobody left to disagree with: the newcomer defines the job
            else:
                return [SendError(conn, Error(ErrorCode.JOB_MISMATCH, True, message), close_after=True)]
        actions: list[Action] = []
        member = job.members.get(hello.rank)
        if member is not None and member.session != hello.session:
            if member.conns:
                message = (f"rank {hello.rank} of job {hello.job!r} is held by a live client at {member.peer} (session "
                           f"{member.session:#x}); a second client at {peer} (session {hello.session:#x}) claimed it: "
                           "each rank needs a client of its own")
                return [SendError(conn, Error(ErrorCode.JOB_MISMATCH, True, message), close_after=True)]
            # The rank's place was kept for a reconnect, and a new client came instead: the
            # worker restarted, and what its old session had sent is void.
            actions += self._lose(job, hello.rank, f"rank {hello.rank} of job {hello.job!r} restarted with a new session", now)
            member = None
            if self._jobs.get(hello.job) is not job:  # that was its last member: the job starts afresh
                job = self._jobs[hello.job] = _Job(hello.job, params)
        if member is None:
            grace = min(hello.reconnect_window_ms / 1000, self.rejoin_grace)
            member = job.members[hello.rank] = _Member(hello.session, grace=grace, peer=peer)
        elif member.left_at is not None:
            actions.append(Log("info", f"rank {hello.rank} of job {hello.job!r} reconnected from {peer} after "
                                       f"{now - member.left_at:.3f}s"))
            member.left_at = None
        member.conns.add(conn)
        member.peer = peer
        job.lost.pop(hello.rank, None)
        self._conns[conn] = _Conn(hello.job, hello.rank, hello.session)
        return actions

    def leave(self, conn: int, reason: str, now: float, *, for_good: bool = False) -> list[Action]:
        """A connection closed or failed. A rank whose client reconnects (its HELLO gave a
        reconnect window) keeps its place for the rejoin grace: its open contributions stay, and
        the results it did not acknowledge are kept for it; unless the worker said its client
        closed (``for_good``): nothing will reconnect, and a new client for the rank must not
        look like a restarted worker. Otherwise, when a rank loses its last connection, the
        job's open chunks that still need it fail, naming the rank (modes that tolerate
        stragglers carry on as long as a quorum can still form)."""
        info = self._conns.pop(conn, None)
        self._waiting.pop(conn, None)
        self._receiving.pop(conn, None)
        if info is None:
            return []
        job = self._jobs.get(info.job)
        if job is not None:
            self._disengage_conn(job, conn)
        member = None if job is None else job.members.get(info.rank)
        if job is None or member is None or member.session != info.session:
            self._release_unacked(info)
            return []
        member.conns.discard(conn)
        why = f"rank {info.rank} of job {info.job!r} disconnected ({reason})"
        if member.grace > 0 and not for_good:
            undelivered = job.undelivered.setdefault(info.rank, {})
            for delivery in info.unacked:
                kept = undelivered.pop(delivery.chunk_key, None)
                if kept is not None:
                    kept.done()
                undelivered[delivery.chunk_key] = delivery
            info.unacked.clear()
            if member.conns or member.left_at is not None:
                return []
            member.left_at = now
            return [Log("info", f"{why}; its place is kept for {member.grace:.1f}s while it reconnects")]
        self._release_unacked(info)
        # One broken stream means the client is broken: drop its siblings too.
        actions: list[Action] = []
        for sibling in sorted(member.conns):
            sibling_info = self._conns.pop(sibling, None)
            self._disengage_conn(job, sibling)
            if sibling_info is not None:
                self._release_unacked(sibling_info)
            actions.append(CloseConnection(sibling))
        member.conns.clear()
        return actions + self._lose(job, info.rank, why, now)

    def _lose(self, job: _Job, rank: int, why: str, now: float) -> list[Action]:
        """Rank ``rank`` is gone for good: fail what needed it, drop what was kept for it."""
        member = job.members.pop(rank, None)
        if member is not None:
            for conn in member.conns:
                info = self._conns.pop(conn, None)
                if info is not None:
                    self._release_unacked(info)
        for delivery in job.undelivered.pop(rank, {}).values():
            delivery.done()
        for chunk in job.open.values():  # contributions of the old session that never finished
            if not isinstance(chunk, _CutThroughChunk):
                continue
            part = chunk.parts.get(rank)
            if part is not None and not part.writing and part.received < part.shared.buffer.nbytes:
                del chunk.parts[rank]
                part.chunk = None
                part.shared.release()
        job.lost[rank] = why
        for closed in job.retained:  # results kept for this rank will not be collected
            if closed.result is not None:
                closed.answered |= 1 << rank
                if bin(closed.answered).count("1") >= job.params.world_size:
                    self._drop_retained(closed)
        failed: list[Action] = []
        for chunk_key, chunk in list(job.open.items()):
            if self._can_still_close(job, chunk):
                continue
            failed += self._fail(job, chunk_key, ErrorCode.PEER_LOST, f"{why}; chunk cannot complete", now)
        actions: list[Action] = [Log("warning" if failed else "info", why)]
        actions += failed
        if not job.members and not self._keeps_results(job):
            self._drop_job(job)
        return actions

    @staticmethod
    def _keeps_results(job: _Job) -> bool:
        """Results still kept for ranks that have not collected them (a straggler may connect
        after the others have finished and left)."""
        return any(closed.result is not None for closed in job.retained)

    def _can_still_close(self, job: _Job, chunk: _OpenChunk) -> bool:
        if job.params.mode is StragglerMode.ALL:
            return not job.lost
        alive = chunk.contributors
        for rank in job.members:
            alive |= 1 << rank
        return bin(alive).count("1") >= job.params.quorum

    def _drop_job(self, job: _Job) -> None:
        for chunk in job.open.values():
            chunk.free(self, job)
        for kept in job.undelivered.values():
            for delivery in kept.values():
                delivery.done()
        job.undelivered.clear()
        for closed in job.retained:
            if closed.result is not None:
                closed.result.release()
        del self._jobs[job.name]
        if self._active.get(job.name) is job:
            del self._active[job.name]
            self.memory_epoch += 1
