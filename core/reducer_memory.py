"""The reducer's memory rules (docs/reliability.md, "Fair shares"): what counts against the job
and reducer-wide budgets, how active jobs share the budget when it is contended, which pushes wait
for memory and for how long, and what is reclaimed under pressure (slow pushes, stalled chunks of
jobs over their share).

:class:`_MemoryRules` is ``ReducerCore``'s base class, kept apart so that these rules read in one
place; it holds no state of its own (``ReducerCore.__init__`` sets what it declares) and, like
the rest of the core, no socket, thread or clock.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Callable

import numpy as np

from . import constants as C
from .buffer_pool import BufferPool
from .combine import Combiner
from .reducer_actions import Action, Log, SendError
from .reducer_jobs import JobStats, MemoryState, PushTicket, _Conn, _Job, _Wait
from .wire import Error, ErrorCode

__all__: list[str] = []


class _MemoryRules:
    """Budgets, fair shares, waits for memory and reclaiming, for ``ReducerCore``."""

    incarnation: int
    job_budget_bytes: int
    memory_budget_bytes: int
    bytes_held_total: int  # over every job: contributions, sums and results being sent
    budget_wait_timeout: float  # the longest a push waits for memory
    min_push_rate: int  # bytes/s; 0: slow pushes are never dropped
    slow_push_grace: float
    #: Bumped whenever memory is freed or shares change: pushes waiting for memory are worth
    #: asking again only then (the daemon retries them on a change, else once a tick).
    memory_epoch: int
    pool: BufferPool
    job_stats: OrderedDict[str, JobStats]
    _active: dict[str, _Job]  # jobs that hold memory or pushed lately: they divide the budget
    _waiting: dict[int, _Wait]  # connection -> its push waiting for memory
    _receiving: dict[int, PushTicket]  # connection -> the push whose payload is arriving
    _next_contention_log: float
    _jobs: dict[str, _Job]
    _conns: dict[int, _Conn]
    _combiner: Combiner  # its kernels (the data plane) and its float32 scratch for 16-bit pieces

    def stats(self, job: str) -> JobStats:
        """The counters of ``job`` (created on first use; the 1,000 most recent jobs are kept)."""
        stats = self.job_stats.get(job)
        if stats is None:
            stats = self.job_stats[job] = JobStats()
            while len(self.job_stats) > 1000:
                self.job_stats.popitem(last=False)
        else:
            self.job_stats.move_to_end(job)
        return stats

    def _fail(self, job: _Job, chunk_key: tuple[int, int], code: ErrorCode, why: str, now: float) -> list[Action]:
        """Fail a chunk (``reducer_results``)."""
        raise NotImplementedError

    # --- budgets ---

    def _mark_active(self, job: _Job, now: float) -> None:
        job.active_at = now
        if self._active.get(job.name) is not job:
            self._active[job.name] = job
            self.memory_epoch += 1

    def fair_share(self) -> int:
        """What each active job may always hold of the reducer-wide budget: an equal part, and
        at least ``constants.MIN_FAIR_SHARE_BYTES``."""
        return max(self.memory_budget_bytes // max(1, len(self._active)), C.MIN_FAIR_SHARE_BYTES)

    def _room(self, job: _Job, nbytes: int, *, opening: bool, conn: int) -> tuple[bool, str] | None:
        """``None`` when ``job`` may take ``nbytes`` more of the reducer's memory now; else
        (whether the claim is owed to a job within its fair share, why it must wait). A claim that
        ends within its job's share needs only the memory to be there; whatever part of a claim
        lies beyond the share may use only what leaves every other active job room to reach its
        own share (:meth:`_kept_for_others`).

        A push that opens a chunk (``opening``) is owed to its job while the job holds less than
        its share, even where it takes the job past the share (by one chunk at most, 4 MiB): a
        share is rarely a whole number of chunks (1 GiB over 201 jobs is 5.1 MiB), and where
        "within" meant "within after the claim", a job a fraction of a chunk below its share
        did not count as within it, so declared no pressure, and waited with the memory left over
        idle until the waits timed out (with :meth:`_room_evicting`'s case, why a new job's first
        step took 236 s under the fair-share attack with 16 MiB steps, docs/reliability.md, "Fair
        shares"). Owed, such a claim declares pressure while it waits, but the part past the share
        is not exempt from the other jobs' shares: where it was, a slow push announcing a whole
        4 MiB chunk against a 1 MiB share took the memory a new job's steps needed, and that job
        waited a slow-push verdict (10 s) for every step. The next step of a push funded as it
        arrives is owed only where it ends within the share: such a push already holds memory
        mid-payload, and letting it past its share handed the memory a new job would open its
        first chunk with to the slow pushes a fraction below theirs."""
        held, total, budget = job.bytes_held, self.bytes_held_total, self.memory_budget_bytes
        share = self.fair_share()
        owed = held < share if opening else held + nbytes <= share
        if total + nbytes > budget:
            return owed, (f"the reducer holds {total} bytes of its memory budget of {budget} (--memory-budget) over "
                          f"every job; job {job.name!r} holds {held} of its fair share of {share} "
                          f"({len(self._active)} active jobs)")
        if held + nbytes <= share:
            return None
        kept = self._kept_for_others(job, share, conn, owed)
        if total + nbytes + kept <= budget:
            return None
        return owed, (f"job {job.name!r} holds {held} bytes, and {nbytes} more would take it past its fair share of "
                      f"{share} of the memory budget of {budget} (--memory-budget, {len(self._active)} active jobs); "
                      f"{kept} bytes are kept for the other jobs' shares")

    def _kept_for_others(self, job: _Job, share: int, conn: int, owed: bool) -> int:
        """What the other active jobs lack of their fair shares: memory a claim past ``job``'s
        share, on connection ``conn``, must leave free. Owed claims (pushes opening a chunk below
        their job's share) are the exception among themselves: a job whose waiting claims are
        all owed and would each take it past its share keeps nothing against an owed claim that
        goes before it: the job holding less goes first, and of jobs holding alike the one that
        waited longer (the connection breaks a tie). Were such jobs kept their shares
        regardless, jobs whose chunks are larger than their shares would keep the memory for one
        another and all wait, with it idle, until refused. A paused step past its job's share is
        owed nothing and leaves every other share whole, as before: were the slow pushes of the
        fair-share attack, each paused a fraction of a step below its share, let past it by one
        another, they would hold past their shares the memory a new job waits for."""
        if not owed:
            return sum(max(0, share - other.bytes_held) for other in self._active.values() if other is not job)
        own = self._waiting.get(conn)
        place = (job.bytes_held, math.inf if own is None else own.since, conn)
        waits: dict[str, tuple[bool, tuple[int, float, int]]] = {}  # job -> (every claim owed and past its share, its place)
        for other_conn, wait in self._waiting.items():
            other = self._jobs.get(wait.job)
            if other is None:
                continue
            past = wait.within_share and other.bytes_held + wait.claim > share
            entry = (other.bytes_held, wait.since, other_conn)
            was_past, first = waits.get(wait.job, (True, entry))
            waits[wait.job] = (was_past and past, min(first, entry))

        def behind(other: _Job) -> bool:
            past, other_place = waits.get(other.name, (False, place))
            return past and other_place > place

        return sum(max(0, share - other.bytes_held) for other in self._active.values()
                   if other is not job and not behind(other))

    def _room_evicting(self, job: _Job, nbytes: int, *, opening: bool, conn: int) -> tuple[bool, str] | None:
        """:meth:`_room`, after dropping the results kept for ``job``'s own ranks that they have
        not acknowledged, where that makes the room. A worker's acknowledgements come behind its
        next push, which is not read while it waits for memory: a job whose share its own
        delivered results filled waited on itself, with no job within its share waiting and so
        nothing reclaimed, until the waits timed out (236 s under the fair-share attack with
        16 MiB steps, docs/reliability.md, "Fair shares")."""
        short = self._room(job, nbytes, opening=opening, conn=conn)
        if short is not None:
            self._evict_deliveries([job], lambda: self._room(job, nbytes, opening=opening, conn=conn) is None)
            short = self._room(job, nbytes, opening=opening, conn=conn)
        return short

    def _wait(self, conn: int, job: _Job, rank: int, now: float, limit: float, claim: int, within_share: bool,
              why: str) -> None:
        wait = self._waiting.get(conn)
        if wait is None:
            self._waiting[conn] = _Wait(job.name, rank, now, limit, claim, why, within_share)
            self.stats(job.name).memory_waits += 1
        else:
            wait.claim, wait.why, wait.within_share = claim, why, within_share


    def _evict_deliveries(self, jobs: list[_Job], enough: Callable[[], bool]) -> None:
        """Memory is short: drop the results kept for workers that have not acknowledged them yet,
        oldest first, until ``enough()``. They are only insurance for a reconnect (R22), and a
        worker's acknowledgement may be queued behind the very push that waits for this memory."""
        for job in jobs:
            for member in job.members.values():
                for conn in member.conns:
                    info = self._conns.get(conn)
                    while info is not None and info.unacked and not enough():
                        info.unacked.popleft().done()
            if enough():
                return


    def _freer(self, job: _Job) -> Callable[[int], None]:
        def freed(nbytes: int) -> None:
            job.bytes_held -= nbytes
            self.bytes_held_total -= nbytes
            self.memory_epoch += 1

        return freed

    def _take(self, job: _Job, nbytes: int, *, charge: int | None = None, lazy: bool = False) -> np.ndarray | None:
        """A buffer of ``nbytes``, of which ``charge`` (all by default) count against the budgets
        now; ``lazy`` for one funded as its bytes arrive (BufferPool.take)."""
        if nbytes == 0:
            return None
        self._charge(job, nbytes if charge is None else charge)
        return self.pool.take(nbytes, lazy=lazy)

    def _charge(self, job: _Job, nbytes: int) -> None:
        """Count ``nbytes`` more against the budgets. The pool's free buffers are memory too: what
        it keeps shrinks so that held and free memory together stay within the reducer-wide
        budget (a churn of pushes dropped and replaced would otherwise park a budget's worth of
        written buffers in the pool beside the budget held)."""
        job.bytes_held += nbytes
        self.bytes_held_total += nbytes
        room = self.memory_budget_bytes - self.bytes_held_total
        if self.pool.free_bytes > room:
            self.pool.trim(max(0, room))

    def _give(self, job: _Job | None, buffer: np.ndarray | None, charged: int | None = None) -> None:
        if buffer is None:
            return
        charged = buffer.nbytes if charged is None else charged
        if job is not None:  # None: the job was dropped meanwhile, its own count with it
            job.bytes_held -= charged
        self.bytes_held_total -= charged
        self.memory_epoch += 1
        if charged == buffer.nbytes:  # only wholly written memory goes back to the pool
            self.pool.give(buffer)


    # --- pressure (tick) ---

    def _reclaim(self, now: float) -> list[Action]:
        """Memory pressure (a job within its fair share waits for memory): a push that delivered
        less than ``min_push_rate`` over a whole ``slow_push_grace`` window, or that waited that
        long for memory mid-payload for a step that would take its job past its share, is
        dropped: its rank is told the rate and disconnected, its chunk fails with OVERLOADED for
        the job's other ranks. A chunk of a job over its share that received nothing for the
        grace and has no push arriving (waiting for a rank that hangs) fails too, oldest first,
        until the job is back within its share. Without pressure nothing is dropped, however
        slow."""
        if not self.min_push_rate:
            return []
        grace = self.slow_push_grace
        share = self.fair_share()
        for ticket in self._receiving.values():  # the rate is measured always, acted on only under pressure
            if ticket.paused_at is not None:
                # Paused, a push wants a step its job's share does not hold (_room: a step is within
                # only where it ends within the share), so it waits for memory that a job within
                # its share needs first. Where the floor of a share makes the shares add up to more
                # than the budget (more active jobs than budget / floor), every stalled job sits
                # exactly at its share; where the share is not a whole number of steps, a fraction
                # of a step below it: either way the step passes the share.
                job = self._jobs.get(ticket.job)
                if job is not None and job.bytes_held + ticket.next_step > share and now - ticket.paused_at >= grace:
                    ticket.slow_rate = 0.0
            elif now - ticket.window_at >= grace:
                rate = (ticket.received - ticket.window_bytes) / (now - ticket.window_at)
                ticket.slow_rate = rate if rate < self.min_push_rate else None
                ticket.window_at, ticket.window_bytes = now, ticket.received
        if not any(wait.within_share for wait in self._waiting.values()):
            return []
        actions: list[Action] = []
        for ticket in [t for t in self._receiving.values() if t.slow_rate is not None]:
            actions += self._drop_push(ticket, share, now)
        for job in [j for j in self._active.values() if j.bytes_held > share]:
            for chunk_key, chunk in sorted(job.open.items(), key=lambda item: item[1].opened_at):
                if job.bytes_held <= share or self._jobs.get(job.name) is not job:
                    break
                if now - max(chunk.active_at, chunk.opened_at) < grace or chunk.writing():
                    continue  # a push still arriving is judged by its own rate, above
                held = job.bytes_held
                self.stats(job.name).chunks_reclaimed += 1
                actions += self._fail(job, chunk_key, ErrorCode.OVERLOADED,
                                      f"job {job.name!r} holds {held} bytes, over its fair share of {share} of the "
                                      f"reducer's memory budget, while jobs within their share wait for memory; this "
                                      f"chunk received nothing for {now - max(chunk.active_at, chunk.opened_at):.1f}s "
                                      f"(waiting for rank(s) {chunk.missing(job.params.world_size)}) and was failed to free its "
                                      "memory", now)
                self.stats(job.name).bytes_reclaimed += max(0, held - job.bytes_held)
        return actions

    def _drop_push(self, ticket: PushTicket, share: int, now: float) -> list[Action]:
        job = self._jobs.get(ticket.job)
        info = self._conns.get(ticket.conn)
        self._receiving.pop(ticket.conn, None)
        if job is None or info is None:
            return []
        push, rank = ticket.push, ticket.rank
        size = 0 if ticket.buffer is None else ticket.buffer.nbytes
        what = f"its push of key {push.key:#x} chunk {push.chunk} ({ticket.received} of {size} bytes in)"
        if ticket.paused_at is not None:
            why = (f"rank {rank} of job {job.name!r}: {what} waited {now - ticket.paused_at:.1f}s for memory while its "
                   f"job held {job.bytes_held} bytes, so that its next step would take it past its fair share of {share}, "
                   "and jobs within their share waited")
        else:
            why = (f"rank {rank} of job {job.name!r}: {what} arrived at {ticket.slow_rate or 0.0:.0f} B/s over the last "
                   f"{self.slow_push_grace:.1f}s, under the minimum of {self.min_push_rate} B/s (REDSRV_MIN_PUSH_RATE) "
                   "while jobs within their share waited for the reducer's memory")
        why += "; the push was dropped and its memory freed"
        member = job.members.get(rank)
        if member is not None and member.session == info.session:
            member.grace = 0.0  # dropped on purpose: its place is not kept for a reconnect
        stats = self.stats(job.name)
        stats.pushes_dropped += 1
        part = ticket.part
        stats.bytes_reclaimed += part.shared.charged if part is not None else size
        actions: list[Action] = []
        if part is not None and part.chunk is not None:
            part.chunk.conns.pop(rank, None)  # told below, once, as it is disconnected
            actions += self._fail(job, (part.chunk.key, part.chunk.chunk), ErrorCode.OVERLOADED, why, now)
        else:
            actions.append(Log("warning", why))
        # The daemon closes the connection, and its abort_push frees what the push held.
        actions.append(SendError(ticket.conn, Error(ErrorCode.OVERLOADED, True, why, push.key, push.chunk), close_after=True))
        return actions

    def _refuse_waits(self, now: float) -> list[Action]:
        actions: list[Action] = []
        for conn, wait in list(self._waiting.items()):
            if now - wait.since < wait.limit:
                continue
            del self._waiting[conn]
            self.stats(wait.job).memory_refusals += 1
            message = (f"no memory for rank {wait.rank} of job {wait.job!r} after waiting {now - wait.since:.1f}s (its "
                       f"operation timeout, {wait.limit:.1f}s at most): {wait.why}")
            actions += [Log("warning", message), SendError(conn, Error(ErrorCode.OVERLOADED, True, message), close_after=True)]
        if self._waiting and any(w.within_share for w in self._waiting.values()) and now >= self._next_contention_log:
            self._next_contention_log = now + C.CONTENTION_LOG_INTERVAL_S
            actions.append(Log("warning", self._contention_report()))
        return actions

    def _contention_report(self) -> str:
        """Who holds the reducer's memory, for the log while it is contended."""
        mib = 1 << 20
        holders = sorted(self._active.values(), key=lambda j: j.bytes_held, reverse=True)
        waiting: dict[str, int] = {}
        for wait in self._waiting.values():
            waiting[wait.job] = waiting.get(wait.job, 0) + 1
        top = "; ".join(
            f"job {job.name!r} holds {job.bytes_held / mib:.1f} MiB, {waiting.get(job.name, 0)} push(es) waiting, "
            f"{self.stats(job.name).memory_refusals} refused, {self.stats(job.name).pushes_dropped} dropped as slow"
            for job in holders[:5])
        return (f"memory contended: {self.bytes_held_total / mib:.1f} MiB of the {self.memory_budget_bytes / mib:.1f} MiB "
                f"budget held, {len(self._active)} active jobs, fair share {self.fair_share() / mib:.1f} MiB, "
                f"{len(self._waiting)} push(es) waiting for memory; largest holders: {top}")

    def memory(self) -> MemoryState:
        """The reducer-wide budget now."""
        return MemoryState(self.memory_budget_bytes, self.bytes_held_total, len(self._active), self.fair_share(),
                           len(self._waiting), any(w.within_share for w in self._waiting.values()))
