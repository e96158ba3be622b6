"""The fleet's origin bytes against its peer bytes: the operator asks each serving pod's sidecar.

For every ModelLoad with ``spec.peers``, a background task (:class:`FleetPoller`) asks, every
``fleet_interval`` seconds, each pod whose sidecar runs and serves peers for ``/peer/v1/stats`` on its peer
port, with the ModelLoad's peer token, and writes the sums into ``status.fleet``. Besides this, the
operator opens connections to pods only to ask a sidecar that is not ready why
(:mod:`modelload.operator.load_reasons`): everything else it learns from the pods' own status
(:mod:`modelload.operator.pods`).

The figures are the *live* fleet's: the sum over the pods serving now. A pod that left stops counting, and
a restarted sidecar starts its counters at zero. A cumulative total is deliberately not kept: it would
live in one replica's memory (every replica runs the handlers, so two would keep two totals), it would miss
the bytes a pod moved between its last poll and its deletion, and it would restart at the operator's start.

Failures are never the ModelLoad's: a pod that does not answer in ``timeout`` seconds, refuses the token or
answers something that is not a peer's stats is counted in ``pods`` and not in ``reporting``, and named
in a log line when the set of silent pods changes. No condition, no Event, no retry. The token is read from
the ModelLoad's peer Secret at each poll (only when there are pods to ask) and never sent: each request is
signed with it and each answer must prove it (:mod:`modelload.loader.peerwire`, as between sidecars), so a
process posing as a pod's sidecar can neither learn the token nor feed the status figures. An answer is
used only within bounds: no redirect followed, at most :data:`MAX_BODY` bytes nested at most
:data:`MAX_DEPTH` deep, and every figure a whole number from 0 to 2^63 - 1. The token is never logged,
stored or put in an exception.

Cheap at rest: no pods, no connection and no Secret read; and the status is written only when a figure
changed.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import aiohttp

from modelload.loader.peerwire import (
    DIGEST_HEADER,
    PROOF_HEADER,
    Answer,
    PeerKey,
    Request,
    load_json,
    parse_digest,
)
from modelload.loader.wiring import PEER_STATS_PATH
from modelload.operator.conditions import now_rfc3339
from modelload.operator.kube import Kube, KubeError, KubeNotFoundError
from modelload.operator.peers import TOKEN_KEY, peer_names
from modelload.operator.pods import PodLoad
from modelload.operator.polling import IndexPoller, Selector, answering_entry

__all__ = ["FleetPoller", "PodStats", "fleet_body", "sum_stats"]

logger = logging.getLogger(__name__)

TIMEOUT = 2.0
"""Seconds a pod has to answer (connect and body): a slow pod must not hold up the others' figures."""
CONCURRENCY = 16
"""Stats requests in flight at once, over every ModelLoad."""
MAX_BODY = 1 << 16
"""Bytes of a stats answer read at most: a sidecar's is a few hundred."""
MAX_DEPTH = 2
"""A stats document is one flat object (a value may be a list at most)."""
MAX_FIGURE = (1 << 63) - 1
FIGURES: tuple[tuple[str, str], ...] = (
    ("origin_bytes", "originBytes"),
    ("peer_bytes", "peerBytes"),
    ("uploaded_bytes", "servedBytes"),
    ("mismatches", "mismatches"),
)
"""The sidecar's stats keys summed, and their names in ``status.fleet``."""


@dataclass(frozen=True)
class PodStats:
    """One pod's answer: its counters, or why there are none (``error``, for the log)."""

    pod: str
    figures: Mapping[str, int] | None = None
    error: str | None = None


def _figures(doc: Any) -> dict[str, int] | None:
    """The counters of a peer's stats document, or None when it is not one."""
    if not isinstance(doc, dict):
        return None
    out = {}
    for key, _ in FIGURES:
        value = doc.get(key)
        if type(value) is not int or not 0 <= value <= MAX_FIGURE:
            return None
        out[key] = value
    return out


async def fetch(session: aiohttp.ClientSession, load: PodLoad, token: str, *, timeout: float) -> PodStats:
    """Ask one pod's sidecar for its stats. Never raises for the pod's faults: they become ``error``."""
    address = load.address
    if not address:
        return PodStats(load.pod, error="has no pod IP yet")
    url = f"http://{address}{PEER_STATS_PATH}"
    key = PeerKey(token)
    signed = key.sign(Request("GET", PEER_STATS_PATH, address))  # good at this pod's address only
    headers = {"Host": address, "Authorization": signed.authorization}
    try:
        async with session.get(url, headers=headers, allow_redirects=False) as response:
            if response.status == 401:
                return PodStats(
                    load.pod,
                    error="refused the peer token (HTTP 401): is the Secret the pod's, and its sidecar of"
                    " this release?",
                )
            if response.status == 421:
                return PodStats(load.pod, error=f"is not what answers at {address} (HTTP 421)")
            if response.status != 200:
                return PodStats(load.pod, error=f"answered HTTP {response.status}")
            if (response.content_length or 0) > MAX_BODY:
                return PodStats(load.pod, error=f"answered over {MAX_BODY} bytes")
            body = await response.content.read(MAX_BODY + 1)
            proof, claimed = response.headers.get(PROOF_HEADER), response.headers.get(DIGEST_HEADER)
    except asyncio.TimeoutError:
        return PodStats(load.pod, error=f"no answer in {timeout:g} s")
    except (aiohttp.ClientError, OSError) as exc:
        # The class name only: an exception's text may quote the request, and so the header.
        return PodStats(load.pod, error=f"unreachable ({type(exc).__name__})")
    digest = hashlib.sha256(body).hexdigest()
    if parse_digest(claimed) != digest or not key.proven(
        proof, signed.nonce, Answer(200, PEER_STATS_PATH), digest
    ):
        return PodStats(load.pod, error="answered without proving the peer token: not the pod's sidecar?")
    try:
        figures = _figures(load_json(body, max_bytes=MAX_BODY, max_depth=MAX_DEPTH))
    except ValueError:
        figures = None
    if figures is None:
        return PodStats(load.pod, error="answered something that is not a peer's stats")
    return PodStats(load.pod, figures=figures)


def sum_stats(asked: int, answers: Iterable[PodStats]) -> dict[str, Any]:
    """``status.fleet`` (without ``updated``) from the answers of the ``asked`` pods."""
    got = [a.figures for a in answers if a.figures is not None]
    body: dict[str, Any] = {"pods": asked, "reporting": len(got)}
    for key, field in FIGURES:
        body[field] = sum(f[key] for f in got)
    return body


def fleet_body(figures: Mapping[str, Any], *, now: str) -> dict[str, Any]:
    return {**figures, "updated": now}


class FleetPoller(IndexPoller):
    """Every ``interval`` seconds, the stats of every peered ModelLoad's serving pods into its status.

    ``models`` and ``pods`` are kopf's live indices (:func:`modelload.operator.handlers.modelloads_by_label`
    and ``pod_loads``), handed over at start-up: the poller reads them, kopf keeps them current.
    """

    task_name = "modelload-fleet-stats"
    what = "reading the peer fleets' stats"

    def __init__(self, kube: Kube, *, interval: float, timeout: float = TIMEOUT) -> None:
        super().__init__(interval=interval)
        self._kube = kube
        self._timeout = timeout
        self._written: dict[Selector, dict[str, Any]] = {}
        self._silent: dict[Selector, frozenset[str]] = {}
        self._limit = asyncio.Semaphore(CONCURRENCY)

    async def poll(self, models: Mapping[Selector, Any], pods: Mapping[Selector, Any]) -> None:
        """One round over every peered ModelLoad (each concurrently)."""
        peered: dict[Selector, str] = {}
        for selector, owners in list(models.items()):
            owner = answering_entry(owners)  # of several ModelLoads of one label, the one pods get
            if owner is not None and owner[2]:  # (name, bytes, peers, ...)
                peered[selector] = owner[0]
        for gone in set(self._written) - set(peered):
            self._written.pop(gone, None)
            self._silent.pop(gone, None)
        if not peered:
            return
        timeout = aiohttp.ClientTimeout(total=self._timeout)
        connector = aiohttp.TCPConnector(limit=CONCURRENCY, force_close=True)
        async with aiohttp.ClientSession(timeout=timeout, connector=connector, trust_env=False) as session:
            await asyncio.gather(
                *(
                    self._one(session, selector, name, list(pods.get(selector, [])))
                    for selector, name in peered.items()
                )
            )

    async def _one(
        self,
        session: aiohttp.ClientSession,
        selector: Selector,
        name: str,
        loads: Iterable[PodLoad],
    ) -> None:
        namespace = selector[0]
        serving = [p for p in loads if p.serving and p.address]
        answers: list[PodStats] = []
        if serving:
            token = await self._token(namespace, name)
            if token is None:
                answers = [PodStats(p.pod, error="not asked: no peer token to ask with") for p in serving]
            else:
                answers = list(await asyncio.gather(*(self._fetch(session, p, token) for p in serving)))
        figures = sum_stats(len(serving), answers)
        if self._written.get(selector) == figures:
            return
        self._report_silent(selector, name, answers)
        try:
            await self._kube.patch_modelload_status(
                namespace, name, {"fleet": fleet_body(figures, now=now_rfc3339())}
            )
        except KubeNotFoundError:
            self._written.pop(selector, None)  # deleted meanwhile
            return
        except KubeError as exc:
            logger.warning("cannot write ModelLoad %s/%s's fleet figures: %s", namespace, name, exc)
            return
        self._written[selector] = figures

    async def _fetch(self, session: aiohttp.ClientSession, load: PodLoad, token: str) -> PodStats:
        async with self._limit:
            return await fetch(session, load, token, timeout=self._timeout)

    async def _token(self, namespace: str, name: str) -> str | None:
        secret = peer_names(name)
        try:
            data = await self._kube.read_secret(namespace, secret)
        except KubeError as exc:
            logger.warning("cannot read the peer token of ModelLoad %s/%s: %s", namespace, name, exc)
            return None
        value = data.get(TOKEN_KEY)
        if not value:
            logger.warning(
                "Secret %s/%s has no %r key: its pods cannot be asked",
                namespace,
                secret,
                TOKEN_KEY,
            )
            return None
        return value.decode("utf-8", "replace").strip()

    def _report_silent(self, selector: Selector, name: str, answers: list[PodStats]) -> None:
        """Name the pods that did not answer, once each time that set changes."""
        silent = {a.pod: a.error or "" for a in answers if a.figures is None}
        if frozenset(silent) == self._silent.get(selector, frozenset()):
            return
        self._silent[selector] = frozenset(silent)
        if silent:
            reasons = "; ".join(f"{pod}: {why}" for pod, why in sorted(silent.items()))
            level = logging.WARNING if any("401" in why for why in silent.values()) else logging.INFO
            logger.log(
                level,
                "ModelLoad %s/%s: %d of %d serving pods did not report peer stats (%s)",
                selector[0], name, len(silent), len(answers), reasons,
            )  # fmt: skip
