"""comm's names for its sibling packages (not for users; `reshard.comm`'s `__all__` is the user face).

Each name here is used by another package of `reshard/` and by no user: the layering test allows this module, and
only it, across rooms.
    as_timedelta: a timeout in seconds or a `timedelta`, checked, as a `timedelta` (refit's rounds).
    broadcast_bytes: one rank's bytes on every rank, one broadcast over the control backend, a tree, not a star
        (refit's metadata round).
"""

from reshard.comm._group import as_timedelta
from reshard.comm._handshake import broadcast_bytes

__all__ = ["as_timedelta", "broadcast_bytes"]
