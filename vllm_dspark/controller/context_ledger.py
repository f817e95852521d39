"""Which live requests keep drafter context.

A request admitted while the controller is dormant, or whose prefix-cache
hit lacks drafter context (proposer/drafter_slots.py), gets none: it is never
drafted (its verify cap is 0) and its context is neither queued nor written,
for the rest of its life. A step run without speculation (plain) gives the
drafter no context, so every request in it loses its own.
"""

from collections.abc import Container, Iterable

_NONE: frozenset[str] = frozenset()


class ContextLedger:
    def __init__(self):
        self._without: set[str] = set()

    def __len__(self) -> int:
        return len(self._without)

    def forget(self, finished: Iterable[str]) -> None:
        """Requests that finished hold no context to track."""
        if self._without and finished:
            self._without.difference_update(finished)

    def admit(self, new_ids: tuple[str, ...], stale: frozenset[str], req_ids: list[str],
              dormant: bool) -> tuple[int, int]:
        """This step's new requests, among ``req_ids`` (``stale``: those whose
        cached prefix lacks drafter context): (how many were admitted without
        context, how many of ``req_ids`` have context)."""
        without = self._without
        added = 0
        if new_ids and (dormant or stale):
            lost = new_ids if dormant else [rid for rid in new_ids if rid in stale]
            without.update(lost)
            added = len(lost)
        contexts = len(req_ids) - sum(rid in without for rid in req_ids) if without else len(req_ids)
        return added, contexts

    def lose_all(self, req_ids: Iterable[str]) -> None:
        """A plain step: every request in it keeps no context."""
        self._without.update(req_ids)

    def all_without(self, req_ids) -> bool:
        """No request of ``req_ids`` has context."""
        without = self._without
        return len(without) >= len(req_ids) and all(rid in without for rid in req_ids)

    def zero_caps(self, req_ids: list[str], caps: list[int]) -> list[int]:
        """``caps`` with 0 for the requests without context."""
        without = self._without
        return [0 if rid in without else c for rid, c in zip(req_ids, caps)] if without else caps

    def among(self, req_ids: list[str]) -> frozenset[str]:
        """Those of ``req_ids`` without context."""
        without = self._without
        return frozenset(rid for rid in req_ids if rid in without) if without else _NONE

    def wanted(self, live: Container[str]) -> Container[str]:
        """The request ids whose queued context is still to be written: in
        ``live`` (the runner's requests) and with context."""
        return _Wanted(live, self._without)


class _Wanted:
    __slots__ = ("_live", "_without")

    def __init__(self, live: Container[str], without: set[str]):
        self._live, self._without = live, without

    def __contains__(self, req_id: str) -> bool:
        return req_id in self._live and req_id not in self._without
