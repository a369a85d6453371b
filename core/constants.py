"""Default numbers, each with the reason it has the value it has.

Every default here can be overridden through :class:`redsrv.Config` (argument or ``REDSRV_*``
variable); tests shrink the timeouts 10-100x.
"""

from __future__ import annotations

#: Protocol magic; the first four bytes of every frame. A peer that speaks anything else
#: (an HTTP probe, a port scanner, an old build) is rejected at its first frame.
MAGIC = b"RDSV"

#: Bumped on any incompatible change to a header layout or to what a frame means; checked in
#: every frame. 2: a chunk's result may arrive as several RESULT frames, in order (cut-through).
#: 3: HELLO carries the client's reconnect window, ACK frames, more ops and dtypes.
PROTOCOL_VERSION = 3

#: Default reducer port. Unassigned by IANA and above the ephemeral-port floor on most Linux
#: configurations would be a trap, so it sits below 32768.
DEFAULT_PORT = 29600

#: The daemon binds loopback unless told otherwise, so a forgotten flag never exposes an
#: unauthenticated reducer to the network (RELIABILITY R11).
DEFAULT_BIND_HOST = "127.0.0.1"

#: Largest pipeline chunk on the wire (REDSRV_CHUNK_BYTES) of a job of more than SMALL_WORLD_RANKS
#: workers. Every chunk costs Python work, a thread hand-off and wake-ups on both ends, which on a
#: busy host cost more than its bytes do. On the emulated cluster (n=m=4, 2 cores, 2026-11-23, at
#: 3fddf85 where --chunk-kib fixed the full chunk), 64 MiB at 2 Gbit/s (CPU-bound) ran at
#: 0.85-1.21x gloo with 1 MiB chunks and 0.72x with 512 KiB ones. A reducer holds every rank's
#: copy of an open chunk, so a chunk of a large job costs it world_size x this: 1 MiB keeps two
#: chunks of a 64-worker job within DEFAULT_JOB_BUDGET_BYTES.
DEFAULT_CHUNK_BYTES = 1024 * 1024

#: The largest chunk of a job of at most SMALL_WORLD_RANKS workers (``Config.largest_chunk_bytes``):
#: a quarter of the chunks, so a quarter of the per-chunk work, for at most 8 x 4 MiB = 32 MiB per
#: open chunk on a reducer. n=m=4, 64 MiB, alternated with 1 MiB on 2026-11-29 (`sudo redsrv bench
#: emulate --workers 4 --sizes 64 --rounds 2 [--chunk-kib 4096]`, three pairs each): 1.39-1.41x gloo
#: at 2.82-3.46 CPU s/GB against 1.36-1.39x at 3.51-3.74 at 1 Gbit/s, and 0.78-0.80x at 1.40-1.47x
#: gloo's CPU per GB against 0.69-0.79x at 1.48-1.62x with no rate limit (docs/performance.md,
#: "Chunks of 4 MiB"). A reducer funds such a push whole at its header or lets it wait there
#: (WHOLE_FUNDING_MAX_BYTES): funded in steps, under memory pressure it paused at its job's share
#: mid-payload and was dropped, which failed an honest job under the fair-share attack.
SMALL_WORLD_CHUNK_BYTES = 4 * 1024 * 1024
SMALL_WORLD_RANKS = 8

#: Default full chunks per reducer span (``Config.chunks_per_span``, within
#: MIN_FULL_CHUNK_BYTES..chunk size): an all-reduce ends about one full chunk's transfer after its
#: last push (see chunker.full_chunk), so 32 keeps that tail near 3%. n=m=4 at 1 Gbit/s, against a
#: fixed 1 MiB (3fddf85, same session): 64 MiB 0.595 s vs 0.614 s (1.44x vs 1.39x gloo), 16 MiB
#: 0.172 s vs 0.182 s; the 2 Gbit/s 64 MiB run fell from 1.21x to 1.03x gloo (more chunks,
#: CPU-bound) but stays above it. 64 halves the tail for more CPU per byte: on 2026-11-24, 64 MiB,
#: two alternated pairs, n=2 0.98x gloo against 0.96x at +10% CPU per GB, n=4 0.965 of the line
#: rate against 0.952 at +25% (docs/benchmarks/history.md, "2026-11-24: fewer wake-ups"); on a CPU-bound host that costs more
#: than the tail saves, so 32 stays the default. Since cut-through (RESULT_PIECE_BYTES below) the
#: one-chunk tail remains only where results leave whole: the straggler modes, pieces off, and
#: broadcasts, so only those use it by default (``Config.chunks_per_span=None``); with cut-through,
#: full chunks are ``chunk_bytes``. Many operations of a few MiB each (DDP buckets, JAX's leaves)
#: otherwise cost the reducers per chunk: JAX training at n=m=4, 1 Gbit/s (7 operations a step)
#: cost the reducers 0.92-1.03 CPU s per step with 32 per span and 0.79 with full chunks, and ran
#: 0.87-0.91x against 0.97x gloo; 16 and 64 MiB single operations ran the same within the noise
#: (2026-11-25, docs/performance.md, "End-to-end training: JAX and Keras").
CHUNKS_PER_SPAN = 32

#: Cut-through (REDSRV_RESULT_PIECE_BYTES): where every rank must contribute (the default
#: straggler mode), a reducer sums and sends a piece of a chunk as soon as every worker's bytes
#: of it are in, instead of waiting for whole payloads. Results then trail the pushes by about
#: one piece per reducer instead of one full chunk, without the CPU that smaller chunks cost on
#: the push side (one push frame and dispatch per chunk stays). 0 forwards whole chunks only.
#: n=m=4 at 1 Gbit/s, 64 MiB, same-run pair on 2026-11-24: 1.46x gloo at 0.956 of the line rate
#: against 1.43x at 0.938 with whole chunks (n=2 0.98x against 0.96x), CPU per GB within the
#: noise (docs/benchmarks/history.md, "2026-11-24, later: cut-through forwarding"). 512 KiB rather
#: than 128 since 2026-11-25: six alternated pairs at n=m=4, 64 MiB, 1 Gbit/s spent 6-18% less
#: CPU per GB (workers 1.55-2.15 s against 1.76-2.39) at the same or better speed (0.592-0.642 s
#: against 0.585-0.729 s), 16 MiB unchanged within the noise; a piece's extra latency is 4 ms at
#: 1 Gbit/s, less on faster links (docs/performance.md, "Settings and what they cost").
DEFAULT_RESULT_PIECE_BYTES = 512 * 1024

#: SO_RCVBUF of every connection a reducer accepts (REDSRV_RECV_BUFFER_BYTES). 0, the default, keeps
#: the kernel's autotuning, which grows a window to several MiB; that is right where the reducers'
#: links add up to the workers' (the sizing rule): bounding the windows there cost about 2% of the
#: speed and 10-20% more CPU per GB (n=m=4, 64 MiB, alternated pairs on the emulated cluster,
#: 2026-11-26: 300 Mbit/s 0.936/0.943 of the line-rate bound against 0.957/0.958 autotuned, 3.3-3.4
#: CPU s/GB against 2.9-3.0; docs/performance.md, "Fewer reducers than workers").
DEFAULT_RECV_BUFFER_BYTES = 0
#: What `redsrv plan` advises where the reducers are the bottleneck (fewer than the sizing rule asks).
#: The window bounds what each worker has in flight towards a reducer. Where the workers' pushes
#: converge on a reducer's link faster than it drains, autotuned windows overflow the queue of the
#: switch port in front of it; the drops (whole GSO bursts) make CUBIC halve the windows of the flows
#: that lost them, and the port idles at times. With the window bounded, the surplus waits in the
#: workers' own send buffers and the port stays busy without dropping. n=4, m=2 at 1 Gbit/s, 64 MiB,
#: on the emulated cluster (20 ms switch-port queues), 2026-11-26: autotuned 0.75-0.89 of the
#: line-rate bound (five runs), 128 KiB 0.961, 256 KiB 0.965-0.969 (four), 512 KiB 0.914, 1 MiB
#: 0.862; n=2, m=1: 0.986 against 0.861. What decides is whether the windows of the converging flows
#: fit the port's queue: at 300 Mbit/s (750 KB queues) n=4, m=2 ran 0.80-0.89 with 256 KiB and
#: 0.96-0.97 with 128 KiB, but 128 KiB is too small for one or two flows per link at 1 Gbit/s (14-16%
#: slower), so no one fixed value serves every fleet. A window also caps a connection at about its
#: size per round trip: 2.6 GB/s at 100 us for 256 KiB, above what one reducer process moves.
RECOMMENDED_RECV_BUFFER_BYTES = 256 * 1024
#: Below this a receive window costs more in round trips than any queue it spares (32 KiB ran n=8,
#: m=4 at 300 Mbit/s at 0.63 of the bound against 0.72-0.75 with 64 KiB or more).
MIN_RECV_BUFFER_BYTES = 16 * 1024

#: Smallest reducer span (one first ramp chunk): a message smaller than this many bytes per
#: reducer goes to fewer reducers, ``key`` choosing the first (chunker.placement). Below it the
#: extra frames cost more than the shorter transfer saves: n=m=4 at 1 Gbit/s, same session
#: (2026-11-23, one reducer vs four; commands in docs/benchmarks/history.md, "Small messages"), 4 KiB with 0.5 ms
#: delay 3.3-3.6 ms vs 4.9-5.5 ms, 16 KiB 3.9-4.4 vs 5.8-6.3; without delay 64 KiB 2.6-3.0 ms vs
#: 4.4-6.9; 256 KiB on one reducer (this constant raised to 256 KiB) took 14 ms vs 4.7-8 ms.
MIN_SPAN_BYTES = 64 * 1024

#: Smallest full chunk: below it a small message pays more CPU per chunk than the tail saves
#: (16 MiB over four reducers with 128 KiB chunks kept two cores 85% busy and was slower).
MIN_FULL_CHUNK_BYTES = 256 * 1024

#: First (and last) chunk of a span's ramp: each span opens with chunks of this size, doubling up
#: to the full chunk size, and closes with the mirror image. A reducer that returns a chunk's sum
#: once every worker's copy arrived starts (and finishes) its results one small chunk's time
#: after the pushes do, while the middle of the span travels in large chunks that cost little
#: per byte. 64 KiB is ~2 ms over four reducers at 1 Gbit/s. Where the reducers cut through, a
#: chunk's sum leaves in pieces of DEFAULT_RESULT_PIECE_BYTES anyway, so the ramp stops below a
#: piece (``Client._cuts_through``; docs/performance.md, "The ramp under cut-through").
RAMP_FIRST_CHUNK_BYTES = 64 * 1024

#: TCP connections per reducer. One: on the emulated 1 Gbit/s cluster two streams per reducer
#: reached 0.667 G at 4.28 CPU-s/GB and one stream 0.740 G at 3.44 (fewer flows sharing each
#: link unevenly, half the threads and sockets). More streams help only where one TCP flow
#: cannot fill a link.
DEFAULT_STREAMS_PER_REDUCER = 1

#: I/O loop threads per client (``REDSRV_IO_THREADS``), each serving the streams of every k-th
#: reducer. One moves a few GB/s each way on one core (docs/performance.md), more than a 10 or
#: 25 Gbit/s NIC; a faster NIC needs more (``redsrv plan`` says how many). One is also the
#: cheapest: each loop is a thread with its own selector and wake-ups.
DEFAULT_IO_THREADS = 1
#: More loops than this is more likely a typo than a plan (a loop serves whole reducers, and a
#: worker talks to at most a few dozen).
MAX_IO_THREADS = 64

#: With several I/O loops (``REDSRV_IO_THREADS`` > 1), a push of at least this many bytes that a
#: caller's thread sends is left to its stream's loop to write (``IOLoop.send_frame``), so that
#: the loops copy the pushes into their sockets in parallel: written by the caller's thread, every
#: push of an operation is copied by that one thread, whatever the number of loops
#: (docs/performance.md, "On a machine with cores to spare"). Smaller pushes are written at once,
#: as with one loop: a hand-off costs a wake-up, more than their copy.
LOOP_WRITES_MIN_BYTES = 64 * 1024

#: TCP congestion control of every data connection (worker and reducer side), where the system
#: allows it; ``None`` keeps the system default. Each link of a reduction server carries one flow
#: per peer (four per link at n=m=4), each crossing two shared bottlenecks, and the flows pause
#: between chunks. BBR handles that poorly: on the emulated cluster (n=m=4, 64 MiB) it reached
#: 0.87 of the line-rate bound at 1 Gbit/s and 250 Mbit/s where CUBIC reached 0.93-0.96. Ring
#: all-reduce (one flow per link) runs the same under both.
DEFAULT_TCP_CONGESTION = "cubic"

#: Connect (with retries while reducers are still starting) and handshake deadlines.
DEFAULT_CONNECT_TIMEOUT_S = 10.0
DEFAULT_HANDSHAKE_TIMEOUT_S = 5.0

#: Deadline for one collective operation, from submission to the last result. Generous because
#: a step of a large model on a slow network legitimately takes minutes; a hang is what it
#: guards against, not slowness.
DEFAULT_OP_TIMEOUT_S = 300.0

#: Heartbeats: sent when a direction has been idle this long; a peer silent for
#: interval x misses is declared frozen (SIGSTOP, partition) and the connection fails.
DEFAULT_HEARTBEAT_INTERVAL_S = 1.0
DEFAULT_HEARTBEAT_MISSES = 5

#: A reducer warns (naming the missing ranks) when a chunk has been open this long.
DEFAULT_STALL_WARNING_S = 30.0

#: ``close()`` and daemon shutdown finish within this bound, even with peers misbehaving.
DEFAULT_CLOSE_TIMEOUT_S = 10.0

#: A client that broke says why to each reducer still connected (ClientEngine.say_failed); it
#: waits this long at most to finish a frame half on the wire first, or says nothing there.
FAILED_GOODBYE_S = 0.2

#: Push scheduling (client): chunks leave in round-robin order across the reducers, and each
#: stream holds at most this many chunks not yet written to its socket. A stream whose TCP flow
#: runs ahead then waits for the others, so every reducer gets chunk k from every worker at about
#: the same time and no reducer's results lag behind (uneven sharing of one uplink between
#: flows otherwise left a tail of results after the last push). 0 queues everything at once.
DEFAULT_PUSH_WINDOW_CHUNKS = 1

#: ``TCP_NOTSENT_LOWAT`` on data sockets: the kernel keeps at most about this many bytes written
#: but not yet sent, so "written to the socket" means "about to leave", which is what makes the
#: push window above bite (the default send buffer would hide megabytes). 0 leaves it unset.
#: One largest chunk: a socket then takes a whole chunk in one call and wakes the sender about
#: once per chunk. At 128 KiB it woke every 64 KiB sent; on 2026-11-24 (n=m=4, 64 MiB, 1 Gbit/s,
#: four alternated pairs) that cost 2.19-2.79 CPU s/GB against 1.92-2.13, with the same time
#: (0.588-0.594 s against 0.590-0.593 s); 512 KiB and 2 MiB measured like 1 MiB
#: (docs/benchmarks/history.md, "2026-11-24: fewer wake-ups"). It stays 1 MiB where chunks are 4 MiB
#: (SMALL_WORLD_CHUNK_BYTES), as it was measured there.
DEFAULT_SEND_LOWAT_BYTES = DEFAULT_CHUNK_BYTES

#: Largest receive low-water mark (``SO_RCVLOWAT``) for a large payload: bounds how long an
#: event loop may go without seeing a slow link's bytes.
MAX_RECEIVE_LOWAT_BYTES = 4 * 1024 * 1024

#: Largest payload a decoder accepts in one frame. Bounds what a malicious or corrupt length
#: field can make us allocate (RELIABILITY R12/R13). Chunks are far smaller.
DEFAULT_MAX_FRAME_PAYLOAD = 64 * 1024 * 1024

#: Bytes of contributions a reducer holds for one job before it stops reading that job's new
#: chunks (TCP backpressure). 128 MiB covers four workers each a few MiB ahead of the slowest
#: one at 10 Gbit/s, and bounds a reducer serving many jobs.
DEFAULT_JOB_BUDGET_BYTES = 128 * 1024 * 1024

#: Shortest shared secret accepted from any source (R24): 128 bits.
MIN_SECRET_BYTES = 16

#: Longest job id on the wire (UTF-8 bytes); long enough for a UUID plus a readable prefix.
MAX_JOB_ID_BYTES = 128

#: Largest job: the result frame carries a contributor bitmap of world_size bits.
MAX_WORLD_SIZE = 65535

#: Error frames carry a human-readable message; cap it so a peer cannot make us buffer much.
MAX_ERROR_MESSAGE_BYTES = 4096

#: Reconnect backoff while reducers start: first wait, cap.
CONNECT_BACKOFF_INITIAL_S = 0.1
CONNECT_BACKOFF_MAX_S = 5.0

#: Results a client has received unacknowledged, in bytes, that make it acknowledge at once
#: rather than at the next tick (client_engine.IOLoop._serve). An ACK costs the client a frame and
#: the reducer a SAFE back, a quarter of the CPU of a 4 KiB all-reduce (docs/performance.md,
#: "Small operations"); what it spares is the copy of results still unsettled when their
#: operation ends (client_ops.Op.take_back_lent), which costs as much at a few hundred KiB.
#: Smaller results wait for the tick.
PROMPT_ACK_BYTES = 256 * 1024

#: How often the reducer and client re-check deadlines. A tenth of a second is well under any
#: deadline a user would configure and costs nothing when idle.
TICK_INTERVAL_S = 0.1

#: Results of a chunk closed early (first_m / deadline modes) are kept this many op-timeouts
#: so that a late rank still receives the same sum the others got.
LATE_RESULT_RETENTION_FACTOR = 1.0

#: Closed-chunk keys remembered per job to reject late or duplicate contributions as stale.
STALE_KEYS_PER_JOB = 65536

#: A reducer drops a connection whose peer has not taken any of the bytes queued for it for this
#: long (RELIABILITY R25): a stuck reader costs the others seconds, not the operation timeout.
DEFAULT_SEND_STALL_S = 10.0

#: The longest operation timeout a worker may ask a reducer for in its HELLO (R21): a worker
#: asking for more (or for none) gets this. Twice the default, so a default client is never capped.
DEFAULT_MAX_OP_TIMEOUT_S = 2 * DEFAULT_OP_TIMEOUT_S

#: Bytes of contributions and results a reducer holds over every job together (R21), beside the
#: per-job budget: eight jobs at their full budget. Past it, new chunks wait as over a job budget;
#: while it is contended each active job keeps a fair share of it (MIN_FAIR_SHARE_BYTES below).
DEFAULT_MEMORY_BUDGET_BYTES = 8 * DEFAULT_JOB_BUDGET_BYTES

#: Fair shares of the reducer-wide budget (docs/reliability.md, "Fair shares"): while the budget
#: is contended, each active job may always hold budget / active jobs, and never less than this:
#: one funding step (ARRIVAL_STEP_BYTES), so that a job can always open a chunk even when thousands
#: share a reducer (the other ranks' pushes to an open chunk join it whatever the budgets,
#: ReducerCore.begin_push).
MIN_FAIR_SHARE_BYTES = DEFAULT_CHUNK_BYTES

#: A job counts as active for its fair share while it holds memory and for this long after its
#: last push: a training job holds nothing between steps, and its share must still be kept for
#: its next one rather than handed to whoever asks in the gap. Longer than most steps' compute;
#: an idle job's share returns to the others within this bound.
FAIR_SHARE_IDLE_S = 5.0

#: A push that announces more than this is funded as its bytes arrive, one step at a time, rather
#: than for its whole announced size up front (memory backs bytes that arrived or are about to):
#: a header announcing 64 MiB then trickling held 64 MiB of the budget (issue 43). One 1 MiB chunk,
#: so that pushes of 1 MiB are funded whole at their header and never paused mid-payload; the event
#: loop asks the state machine once per step. Pushes up to WHOLE_FUNDING_MAX_BYTES are funded whole
#: too, or wait at their header (below).
ARRIVAL_STEP_BYTES = DEFAULT_CHUNK_BYTES

#: A push of at most this many bytes is funded whole at its header, in pooled memory, or, where
#: its whole size does not fit its job's budget and the reducer's at that moment, waits at its
#: header with none of its payload read (``ReducerCore.begin_push``); a larger one is funded as it
#: arrives, ARRIVAL_STEP_BYTES at a time. Funded as it arrives, a push lands in fresh memory whose
#: pages fault in as its bytes land: 4 MiB chunks in 1 MiB steps cost a reducer 1.0-1.15 CPU s/GB
#: against 0.59-0.65 funded whole (`redsrv bench local --workers 2 --reducers 2 --sizes 64 --reps
#: 40`, docs/performance.md, "Chunks of 4 MiB"); and under memory pressure a push paused
#: mid-payload at its job's share is dropped (docs/reliability.md, "Fair shares").
WHOLE_FUNDING_MAX_BYTES = SMALL_WORLD_CHUNK_BYTES

#: Under memory pressure (a job within its fair share waits for memory), a push delivering less
#: than this many bytes per second over a whole grace period is dropped and its memory freed
#: (REDSRV_MIN_PUSH_RATE; 0 turns the rule off). A sixteenth of a default chunk per second: the
#: slowest honest link measured here, 100 Mbit/s shared by eight flows (docs/performance.md), gives
#: each push about 1.5 MB/s, 24 times more; a trickle of a byte every few seconds, the attack of
#: issue 43, gives almost nothing. Without pressure no push is ever dropped for being slow.
DEFAULT_MIN_PUSH_RATE = 64 * 1024

#: How long a push may stay under the minimum rate (or paused over its job's fair share) while
#: others wait for memory before it is dropped (REDSRV_SLOW_PUSH_GRACE): the heartbeat bound, the
#: silence after which a peer counts as frozen anyway, so it outlasts a TCP retransmission stall
#: of an honest link.
DEFAULT_SLOW_PUSH_GRACE_S = DEFAULT_HEARTBEAT_INTERVAL_S * DEFAULT_HEARTBEAT_MISSES

#: While the budget is contended the reducer logs who holds its memory at most this often.
CONTENTION_LOG_INTERVAL_S = 10.0

#: Connections that have not finished their handshake. At the cap the oldest is dropped for the
#: newest, so a flood of slow connections can never lock a worker out (R20). Each holds a few KiB.
DEFAULT_MAX_PENDING_HANDSHAKES = 1024

#: Joined connections per reducer: beyond it new workers are refused with OVERLOADED.
DEFAULT_MAX_CONNECTIONS = 4096

#: Free pool buffers kept per size: a few steps' chunks of one size for every job.
POOL_KEEP_PER_SIZE = 64

#: Pool buffers unused this long are returned to the system, so RSS goes back near its baseline
#: after a burst or an attack (R21); a training loop reuses its buffers every step, far sooner.
POOL_IDLE_RELEASE_S = 5.0

#: How long a worker keeps reconnecting to a reducer it lost before its operations fail with
#: PeerLostError (RELIABILITY R22): long enough for a Kubernetes pod to be restarted.
DEFAULT_RECONNECT_WINDOW_S = 120.0

#: How long a reducer keeps the place of a rank whose connections broke, for the same client to
#: reconnect (at most the client's own window). A live client is back within its backoff (at most
#: CONNECT_BACKOFF_MAX_S) plus a handshake; a worker that died is declared lost after it, so the
#: rest of its job hears of it this much later than without reconnects.
DEFAULT_REJOIN_GRACE_S = 2 * CONNECT_BACKOFF_MAX_S

#: Most reducer processes one ``redsrv reducer --processes`` starts, and most ports in one
#: ``host:P-Q`` range of a reducer list: one event loop per core, and no host this project has
#: met has more than 256 cores; a larger range is more likely a typo than a plan.
MAX_PROCESSES_PER_REDUCER_HOST = 256

#: How long ``redsrv reducer --processes`` waits before restarting a child that exited on its
#: own, doubling up to the maximum while it keeps failing: a child that dies at start-up (its
#: port taken) must not spin. The workers ride through the restart within their reconnect
#: window (docs/reliability.md), so a second here costs them a second.
PROCESS_RESTART_BACKOFF_S = 0.5
PROCESS_RESTART_BACKOFF_MAX_S = 10.0

#: Host-level reduction (core/host_client.py): each local worker's shared-memory staging area.
#: An operation goes through it in pieces: a piece is copied in, reduced inside the host, sent
#: across hosts (1/L of it by each of the L local workers) and copied out while the next pieces
#: are on their way, so the area bounds a worker's host-level bytes in flight. 64 MiB holds a
#: DDP bucket (25 MiB) whole with room for the next; pages are touched only as pieces use them.
DEFAULT_HOST_SLOT_BYTES = 64 * 1024 * 1024
#: The piece, unless set (``Config.host_piece_bytes``): max(L, reducers) x chunk_bytes, so that
#: each local worker's share of a piece is one full chunk for each of its reducers (each reaches
#: its own reducers: core/host.py, share_reducers), and the per-chunk CPU the flat path pays per
#: chunk_bytes is not paid more often; at most a quarter of the staging area so that four pieces
#: overlap.
HOST_PIECES_IN_SLOT = 4
#: A piece smaller than this costs more in messages between the local workers than it overlaps.
MIN_HOST_PIECE_BYTES = 64 * 1024

#: How long an elastic worker waits at the rendezvous for its world to form (Horovod's
#: HOROVOD_ELASTIC_TIMEOUT default): room for a replacement worker to start on a busy host.
DEFAULT_ELASTIC_TIMEOUT_S = 600.0

#: How many times ``redsrv run --min-np`` re-forms the world before it gives up: a script that
#: fails on start would otherwise be restarted forever.
DEFAULT_ELASTIC_RESET_LIMIT = 100

#: How long the elastic rendezvous holds one request for a world that has not formed yet before
#: it answers "not yet" (the worker then asks again, within its own elastic timeout): short enough
#: that a worker whose driver died notices within this, long enough to cost nothing.
RENDEZVOUS_POLL_S = 5.0

#: Arrays a client allocates per operation (results of operations given no ``out``, copies kept
#: for recovery) of at least this size land in memory a dropped one left behind
#: (``buffer_pool.OutputPool``): glibc's default mmap threshold, above which a fresh array is a
#: new mapping whose page faults cost far more than the pool's bookkeeping.
OUTPUT_POOL_MIN_BYTES = 128 * 1024

#: Free result blocks a client keeps per size: a loop that holds one result while the next
#: arrives needs two.
OUTPUT_POOL_KEEP_PER_SIZE = 2

#: Free chunk-sized blocks a client keeps per size for the copies it keeps for recovery: an
#: operation's chunks, where its results outrun the reducers' SAFE frames.
COPY_POOL_KEEP_PER_SIZE = 64

#: At most this much free memory in each of a client's two pools.
OUTPUT_POOL_MAX_FREE_BYTES = 256 << 20
