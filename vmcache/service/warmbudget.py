"""One disk's side of the host's warm-up budget: ask it before a cycle restores, give back what was not read.

vmcache.host.warmpool keeps the budget (one per backing device, shared by
every agent of the host); vmcache.model.warmshare says what a disk asks
(:func:`~vmcache.model.warmshare.warm_ask`: at most one interval's worth,
at the density of the set's next region - the replay's host mode asks the
same) and who goes first. When the pool cannot be read the disk restores
at ``warm_rate`` on its own, as an agent alone on the host would (one
warning line).
"""

from __future__ import annotations

import logging

from ..errors import HostError
from ..host.warmpool import WarmPool, device_of
from ..logfmt import event
from ..model.params import ModelParams
from ..model.warm import WarmStart
from ..model.warmshare import warm_ask

__all__ = ["WarmBudget"]


class WarmBudget:
    """The warm-up budget of the disk whose image is open as ``fd`` (its device's pool), asked as ``image``."""

    def __init__(self, pool: WarmPool, fd: int, image: str, params: ModelParams, logger: logging.Logger,
                 owner: str = "") -> None:
        """``owner``: the domain (its release drops what a killed agent left). Raises OSError when ``fd`` cannot
        be looked at."""
        self._pool = pool
        self._owner = owner
        self._device = device_of(fd)
        self._image = image
        self._params = params
        self._log = logger
        self._asking = False
        self._failed = False

    def grant(self, warm: WarmStart | None) -> int | None:
        """The bytes this cycle's restore may read; None when there is nothing to restore or no budget to ask
        (the cycle's bucket then fills at ``warm_rate``)."""
        if warm is None or warm.done:
            self.close()
            return None
        ask = warm_ask(warm, self._params, self._pool.rate)
        if ask is None:
            return None
        want, density = ask
        try:
            granted = self._pool.take(self._device, self._image, want, density, self._owner)
        except HostError as err:
            self._fail(err)
            return None
        self._asking = True
        return granted

    def settle(self, unspent: int) -> None:
        """Give back what the cycle was granted and did not read."""
        if not self._asking or unspent <= 0:
            return
        try:
            self._pool.give_back(self._device, self._image, unspent)
        except HostError as err:
            self._fail(err)

    def close(self) -> None:
        """No more asks of this disk (its set is restored, or it stops)."""
        if not self._asking:
            return
        self._asking = False
        try:
            self._pool.forget(self._image)
        except HostError as err:
            self._fail(err)

    def _fail(self, err: HostError) -> None:
        if not self._failed:
            self._log.warning(event("warm.budget_failed", image=self._image, error=err,
                                    action="restoring at warm_rate alone"))
            self._failed = True
