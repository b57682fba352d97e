"""The daemon's second tier: L1 (the pool) spills to and shares through Mooncake Store (tierd.l2).

Imported only with ``--l2-url``. Everything here runs on the daemon's main loop; the Mooncake
client runs in its own process behind :class:`tierd.l2.MooncakeTier`, whose answers come back
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

Modules: ``bridge`` (:class:`SecondTier`, what the daemon calls), ``parts`` (names, fold),
``fetch``, ``spill``, ``lookups``, ``retrieves``, ``metrics`` (/metrics families).
"""

from tierd.tier2.bridge import COUNTERS, SecondTier

__all__ = ["COUNTERS", "SecondTier"]
