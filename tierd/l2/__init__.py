"""Second tier (L2): chunks spilled to and shared through Mooncake Store.

Importing this package never imports Mooncake: only constructing a :class:`MooncakeTier` does,
and without the package that raises :class:`L2Unavailable` naming what to install
(``pip install 'tierd[mooncake]'``). Modules, one concern each:

- ``url``: ``--l2-url mooncake://...`` -> frozen :class:`MooncakeUrl` (pure; documented defaults)
- ``keys``: chunk part -> key bytes -> the object name every node derives alike
- ``worker``: one thread for blocking calls, each answered by its deadline (:class:`Op`)
- ``client``: the Mooncake calls and their return codes (the hazards observed are listed there)
- ``mooncake``: :class:`MooncakeTier`, the verbs the daemon calls, health and reconnects
- ``stats``: counters and latency histograms behind ``MooncakeTier.status()``
"""

from tierd.l2.client import L2Unavailable
from tierd.l2.keys import chunk_key, object_name
from tierd.l2.mooncake import MooncakeTier
from tierd.l2.url import MooncakeUrl, parse_url
from tierd.l2.worker import Op

__all__ = ["L2Unavailable", "MooncakeTier", "MooncakeUrl", "Op", "chunk_key", "object_name", "parse_url"]
