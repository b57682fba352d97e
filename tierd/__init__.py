"""tierd: a node-local KV-cache tier for LLM serving.

Reading the code, layer by layer (each module says what it owns and its hazards;
tests/unit/test_docs_paths.py fails when this map misses a module or names one that is gone).

Its folders are its layers, top first. A module imports only its own layer and those below it
(tests/unit/test_import_graph.py LAYERS: it fails on an import, or a callback held at run time, that
reaches up), so a request goes down and its answer comes back as returned values. A STORE's block
ids go daemon (server: decode) -> core (handlers.store: check them against the layout) -> state
(planner.plan_store: per chunk, the objects it asks for, decided without the pool) -> pool
(reserve: room for each, all of a chunk's objects or none, evicting if it must) -> transfer
(plans.bind: the copies of its blocks into those objects' bytes; then the copy on the rank's lane)
-> back on the main loop: the Job's finish commits, and respond() replies. With a second tier, a
handler that needs it returns what it needs; the loop asks tierd/tier2 and hands the answer back.

The operator's tools.
    tierd/tools/cli.py          tierd serve | status | bench | replay
    tierd/tools/report.py       the tables tierd status and tierd bench print
    tierd/tools/bench/          tierd bench: CPU (cpu), CUDA (cuda, with cuda_baselines, cuda_latency,
                                cuda_interference), TP ranks (ranks, each rank a rank_worker process)
    tierd/tools/replay.py       tierd replay: a request trace through the pool, to size it
    tierd/tools/trace.py        the traces it reads, and what a pool that never evicts would hit
    tierd/tools/testing.py      a private tierd serve in a subprocess, for tests and benches
The daemon as a whole.
    tierd/daemon/server.py      the main loop: receive, decode, dispatch, carry outcomes, and apply
                                what LOOKUP replies did not wait for while nothing waits
    tierd/daemon/assemble.py    what a daemon is built of, from its settings
    tierd/daemon/status.py      /status, built on the main loop for the HTTP thread
    tierd/daemon/warm.py        warm restart: what must be unchanged, what is reported
The request core: requests taken in order, decided, answered.
    tierd/core/backlog.py       the order requests read are handled in (a RETRIEVE before STOREs)
    tierd/core/handlers.py      one handler per op: (tier, call, request) -> outcome (reply | Job | needs)
    tierd/core/jobs.py          Tier, Call; the copy Jobs of STORE and RETRIEVE; what needs the second tier
    tierd/core/outcomes.py      a handler's outcome on the loop: reply, submit a copy, ask the second tier
    tierd/core/respond.py       respond(): every reply and typed error goes out here
The second tier.
    tierd/tier2/                L2: spill, fetch, lookups over L1 and L2 on the main loop; Mooncake
                                Store in a process of its own (mooncake, link, agent)
State, and the planner every layer above plans with.
    tierd/state/registry.py     sessions, registered ranks, namespaces, leases: one owner
    tierd/state/records.py      what it holds: Session, Instance, Lease, and its Limits
    tierd/state/tenants.py      who a session acts as, and what it may touch
    tierd/state/planner.py      STORE decided from (request, geometry) alone: the objects each chunk
                                asks for; RETRIEVE from what the pool holds: objects, copy items, failures
The pool.
    tierd/pool/                 host memory: segments (backed, in huge pages where allowed: pages),
                                slabs and the allocator (alloc), a STORE's room (reserve), eviction
                                (evict, its order in policy, the reuse policy's LRU shadow in shadow),
                                the index, recency and LOOKUP's fold, the pool folder a warm restart
                                reads (persist)
The transfer.
    tierd/transfer/             lanes of copy threads; CPU and CUDA copies between engine and pool
                                (what a request copies: plans; CUDA: the GPU support and each rank's
                                memory in cuda, its DMA lanes in dma, the pool's pinning in pinned)
The edge: bytes in and out.
    tierd/edge/zmtp/            the ROUTER endpoint: ZeroMQ's wire protocol (conn), each message's
                                size bounded, its connection's credentials and end known
    tierd/edge/channel.py       the lookup channel: LOOKUP and PING without ZeroMQ
    tierd/edge/endpoint.py      one daemon per socket path
    tierd/edge/fdinbox.py       engine memory handed over as file descriptors
    tierd/edge/peer.py          who sent a message, as the kernel says
    tierd/edge/http/            /status, /metrics, /healthz: what each answers (endpoints), and the
                                bounded server of connections and threads (server)
The wire and settings, which every layer reads.
    tierd/protocol/             the wire contract both sides import: frames (codec), typed requests
                                with every limit (messages), page layouts and their arithmetic
                                (layout), key hashing (keys), error codes (errors), the socket paths
                                and side-socket constants (sockets), what one copy touches (copies),
                                the versions both sides name: tierd, key format, vLLM (versions)
    tierd/base/config.py        every setting, its flag and its help
    tierd/base/stats.py         counters and histograms
    tierd/base/l2url.py         the --l2-url grammar (pure: config checks the flag with it)

The engine side is tierd_client (client/): TierdClient, the shared-memory and CUDA layouts, and
the vLLM connector (client/vllm_connector/). It imports nothing of tierd but tierd.protocol
(tests/unit/test_client_imports_only_protocol.py).
"""

from tierd.protocol.versions import TIERD_VERSION as __version__  # noqa: F401 - the one version string
