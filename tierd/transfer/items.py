"""The copy items and pitched geometry of tierd.protocol.copies, under the name the transfer
lanes and the planner import them by."""

from tierd.protocol.copies import (  # noqa: F401 - re-exported
    MAX_PITCH,
    CopyItem,
    Pitched,
    events_order_processes,
    pitched,
    pitched_copies,
    row_pitches,
    span_copies,
    split_nulls,
)
