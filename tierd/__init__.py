"""tierd: a node-local KV-cache tier for LLM serving.

Reading the code, in the order a request meets it (each module says what it owns and its hazards;
tests/unit/test_docs_paths.py fails when this map misses a module or names one that is gone).

Layers, top first: the main loop, its setup and the operators' tools; handlers; the second tier;
state (registry, tenants); the planner; the pool; transfer; the wire and settings (protocol,
config, stats, channel, endpoint, peer, zmtp). A module imports only its own layer and those below it
(tests/unit/test_import_graph.py LAYERS: it fails on an import, or a callback held at run time, that
reaches up), so a request goes down and its answer comes back as returned values. A STORE's block ids go
edge (server: decode) -> handler (handlers.store: check them against the layout) -> planner
(plan_store: per chunk, the objects it asks for, decided without the pool) -> pool (reserve: room
for each, all of a chunk's objects or none, evicting if it must) -> transfer (plans.bind: the
copies of its blocks into those objects' bytes; then the copy on the rank's lane) -> back on
the main loop: the Job's finish commits, and respond() replies. With a second tier, a handler that needs it
returns what it needs; the loop asks tierd/tier2 and hands the answer back to the handler.

Edge: bytes in, typed requests out; outcomes in, replies out.
    tierd/server.py       the daemon's main loop: receive, decode, dispatch, carry outcomes
    tierd/backlog.py      the order requests read are handled in (a RETRIEVE before STOREs)
    tierd/outcomes.py     a handler's outcome on the loop: reply, submit a copy, ask the second tier
    tierd/respond.py      respond(): every reply and typed error goes out here
    tierd/assemble.py     what a daemon is built of, from its settings
    tierd/protocol/       the wire contract both sides import: frames (codec), typed requests
                          with every limit (messages), page layouts and their arithmetic
                          (layout), key hashing (keys), error codes (errors), the socket paths
                          and side-socket constants (sockets), what one copy touches (copies),
                          the versions both sides name: tierd, key format, vLLM (versions)
    tierd/channel.py      the lookup channel: LOOKUP and PING without ZeroMQ
    tierd/endpoint.py     one daemon per socket path
    tierd/fdinbox.py      engine memory handed over as file descriptors
    tierd/peer.py         who sent a message, as the kernel says
    tierd/zmtp/           the ROUTER endpoint: ZeroMQ's wire protocol (conn), each message's size
                          bounded, its connection's credentials and end known
Decisions.
    tierd/handlers.py     one handler per op: (tier, call, request) -> outcome (reply | Job | needs)
    tierd/jobs.py         Tier, Call; the copy Jobs of STORE and RETRIEVE; what needs the second tier
Second tier.
    tierd/tier2/          L2: spill, fetch, lookups over L1 and L2 on the main loop; Mooncake Store
                          in a process of its own (mooncake, link, agent)
State.
    tierd/registry.py     sessions, registered ranks, namespaces, leases: one owner
    tierd/records.py      what it holds: Session, Instance, Lease, and its Limits
    tierd/tenants.py      who a session acts as, and what it may touch
Planning: STORE decided from (request, geometry) alone, RETRIEVE from what the pool holds.
    tierd/planner.py      STORE: the objects each chunk asks for; RETRIEVE: objects, copy items,
                          failures
    tierd/pool/           host memory: segments (backed, in huge pages where allowed: pages),
                          slabs and the allocator (alloc), a STORE's room
                          (reserve), eviction (evict, its order in policy, the reuse policy's LRU
                          shadow in shadow), the index, recency and LOOKUP's fold, the pool folder
                          a warm restart reads (persist)
Copies.
    tierd/transfer/       lanes of copy threads; CPU and CUDA copies between engine and pool
                          (what a request copies: plans; CUDA: the GPU support and each rank's
                          memory in cuda, its DMA lanes in dma, the pool's pinning in pinned)
Operators.
    tierd/status.py       /status, built on the main loop for the HTTP thread
    tierd/http/           /status, /metrics, /healthz: what each answers (endpoints), and the
                          bounded server of connections and threads (server)
    tierd/stats.py        counters and histograms
    tierd/config.py       every setting, its flag and its help
    tierd/cli.py          tierd serve | status | bench | replay
    tierd/report.py       the tables tierd status and tierd bench print
    tierd/warm.py         warm restart: what must be unchanged, what is reported
    tierd/bench/          tierd bench: CPU (cpu), CUDA (cuda, with cuda_baselines, cuda_latency,
                          cuda_interference), TP ranks (ranks, each rank a rank_worker process)
    tierd/replay.py       tierd replay: a request trace through the pool, to size it
    tierd/trace.py        the traces it reads, and what a pool that never evicts would hit
    tierd/testing.py      a private tierd serve in a subprocess, for tests and benches

The engine side is tierd_client (client/): TierdClient, the shared-memory and CUDA layouts, and
the vLLM connector (client/vllm_connector/). It imports nothing of tierd but tierd.protocol
(tests/unit/test_client_imports_only_protocol.py).
"""

from tierd.protocol.versions import TIERD_VERSION as __version__  # noqa: F401 - the one version string
