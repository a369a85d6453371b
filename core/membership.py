"""Who is in an elastic job's world, epoch by epoch: the rendezvous's state machine, with no
sockets, threads or clocks (the driver in cli/elastic.py feeds it process exits, the HTTP
rendezvous in core/rendezvous.py feeds it the workers' requests).

An **epoch** is one world: its members in rank order, its size, and a redsrv job of its own on
the same reducers (:func:`epoch_job`), so contributions of two epochs can never meet in one sum.
Horovod's elastic rules, as this machine applies them:

- The first world forms once every worker started has asked to join.
- A world ends when one of its members dies (its process exited) or leaves (asks to join a
  later epoch: it caught a collective's failure, or it saw the hosts-updated signal at a
  commit). The next world forms once every living member has asked: the survivors first, in
  their old rank order, so rank 0 is always a worker that holds the last committed state, then
  the newcomers waiting, up to ``max_size``; it needs ``min_size`` workers, else it waits.
- A newcomer that asks while a world is running waits for that world's next commit, where
  :meth:`Membership.hosts_updated` tells rank 0 to interrupt every member (Horovod's
  ``HostsUpdatedInterrupt``), and then joins the world they form.
- Once a worker exits successfully the job is finishing: no further world forms.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Assignment", "Membership", "epoch_job"]


def epoch_job(job: str, epoch: int) -> str:
    """The redsrv job of one epoch. The base is cut so that the epoch survives the cut that
    process sets make (``job[:100]``) and the whole fits the 128-byte job id.

    >>> epoch_job("run-1a2b", 0), epoch_job("run-1a2b", 3)
    ('run-1a2b.e0', 'run-1a2b.e3')
    """
    return f"{job[:88]}.e{epoch}"


@dataclass(frozen=True)
class Assignment:
    """One worker's place in one epoch."""

    epoch: int
    rank: int
    size: int
    job: str


class Membership:
    """The worlds of one elastic job. Workers are named by the ids the driver gave them."""

    def __init__(self, job: str, *, min_size: int, max_size: int) -> None:
        if not 1 <= min_size <= max_size:
            raise ValueError(f"need 1 <= min_size <= max_size, got {min_size} and {max_size}")
        self.job = job
        self.min_size = min_size
        self.max_size = max_size
        self.epoch = -1
        self.members: list[str] = []  # the current world, in rank order
        self.alive: list[str] = []  # started and not exited, in start order
        self.waiting: dict[str, int] = {}  # worker -> the epoch after which it asks for a place
        self.assignments: dict[str, Assignment] = {}
        self.lost_member = False  # a member of the current world died
        self.finished = False  # a worker exited successfully: the job is ending

    def started(self, worker: str) -> None:
        if worker in self.alive:
            raise ValueError(f"worker {worker!r} was already started")
        self.alive.append(worker)

    def exited(self, worker: str, status: int) -> bool:
        """A worker's process ended; whether a new world formed."""
        if worker not in self.alive:
            return False
        self.alive.remove(worker)
        self.waiting.pop(worker, None)
        if status == 0:
            self.finished = True
        if worker in self.members:
            self.lost_member = True
        return self._form()

    def join(self, worker: str, after_epoch: int) -> tuple[Assignment | None, bool]:
        """``worker`` asks for its place in the first world after ``after_epoch``: (its
        assignment, or ``None`` while that world has not formed; whether a world formed now)."""
        if worker not in self.alive:
            raise ValueError(f"worker {worker!r} is not one the driver started (or it has exited)")
        assigned = self.assignments.get(worker)
        if assigned is not None and assigned.epoch > after_epoch:
            return assigned, False
        self.waiting[worker] = after_epoch
        formed = self._form()
        assigned = self.assignments.get(worker)
        return (assigned if assigned is not None and assigned.epoch > after_epoch else None), formed

    def hosts_updated(self, epoch: int) -> bool:
        """Asked by rank 0 of ``epoch`` at each commit: whether newcomers wait for a place the
        world has room for, so every member should stop at this commit and re-form."""
        if epoch != self.epoch or self.finished or len(self.members) >= self.max_size:
            return False
        return any(worker not in self.members for worker in self.waiting)

    def _form(self) -> bool:
        if self.finished:
            return False
        if self.epoch < 0 and any(w not in self.waiting for w in self.alive):
            return False  # the first world starts with every worker started
        survivors = [w for w in self.members if w in self.alive]
        if any(w not in self.waiting for w in survivors):
            return False  # a living member is still in the current world (or on its way out)
        if self.epoch >= 0 and not self.lost_member and not any(w in self.waiting for w in self.members):
            return False  # the current world is intact
        newcomers = [w for w in self.alive if w in self.waiting and w not in survivors]
        world = (survivors + newcomers)[: self.max_size]
        if len(world) < self.min_size:
            return False
        self.epoch += 1
        self.members = world
        self.lost_member = False
        job = epoch_job(self.job, self.epoch)
        for rank, worker in enumerate(world):
            self.assignments[worker] = Assignment(self.epoch, rank, len(world), job)
            del self.waiting[worker]
        return True
