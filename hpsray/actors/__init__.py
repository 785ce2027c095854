"""Ray actors over the engines (Reader, MemPSShard, SSDPSShard, Trainer): placement, messaging
and metrics only; the logic lives in ``hpsray.tiers``, ``hpsray.data`` and ``hpsray.models``."""
