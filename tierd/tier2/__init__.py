"""The daemon's second tier: L1 (the pool) spills to and shares through Mooncake Store.

Imported only with ``--l2-url``. Everything here runs on the daemon's main loop; the Mooncake
client runs in its own process behind :class:`tierd.tier2.mooncake.MooncakeTier`, whose answers come back
as events on a wake pipe the loop polls. Nothing here ever waits for L2:

- LOOKUP (``lookups``): L1 first; when L1 alone does not hold the whole prompt, the parts it
  lacks are asked with one ``exists`` call and the LOOKUP is answered when L2 answered, or from
  L1 alone at --l2-lookup-timeout-ms. The fold is L1's own over L1 and L2 together (``parts``).
  What it promised from L2 is fetched into L1 at once (pinned by the lease).
- RETRIEVE (``retrieves``): waits for the fetches of its chunks (and fetches what L1 lacks), by
  its deadline; a fetch that failed leaves its blocks failed in the reply (the engine recomputes).
- Fetches (``fetch``) land in freshly allocated L1 slots, nothing in between; puts (``spill``)
  read L1 slots that stay pinned until Mooncake has let go of them.
- L2 trouble (master down, slow, full) degrades to L1 only: counted, logged, never an error.

Importing this package imports nothing (the Mooncake client's own process, ``python -m
tierd.tier2.agent``, starts from it); Mooncake itself is imported only by the agent, and without
it :class:`~tierd.tier2.client.L2Unavailable` names what to install (``pip install
'tierd[mooncake]'``). Modules, one job each:

The daemon's side (its main loop):
- ``bridge``: :class:`SecondTier`, what the main loop and handlers call; its counters
- ``lookups``: LOOKUP over L1 and L2, answered by a deadline (the fold, handed back to the loop)
- ``retrieves``: RETRIEVEs that wait for fetches (handed back to the loop to plan)
- ``fetch``: gets from L2 into fresh L1 slots
- ``spill``: puts of L1 objects to L2 (write-through, write-back), and what eviction took
- ``parts``: the L2 objects of a chunk, their names, the fold over L1 and L2
- ``metrics``: the ``tierd_l2_*`` /metrics families

Mooncake Store, in a process of its own:
- ``mooncake``: :class:`MooncakeTier`, the verbs the daemon calls, health and reconnects
- ``link``: the pipe to the agent process; ``agent``: that process; ``relay``: calls over the link
- ``client``: the Mooncake calls and their return codes (the hazards observed are listed there)
- ``worker``: one thread for blocking calls, each answered by its deadline (:class:`Op`)
- ``buffers``: the agent's transfer buffers
- ``keys``: chunk part -> key bytes -> the object name every node derives alike
- ``url``: ``--l2-url mooncake://...`` -> frozen :class:`MooncakeUrl` (pure; documented defaults)
- ``stats``: counters and latency histograms behind ``MooncakeTier.status()``
"""
