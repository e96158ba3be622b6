"""How a load's bytes reach the segment: through its file descriptor (``splice``) or through its mapping.

Both paths give the same guarantees (the engine verifies, decrypts in place, resumes at the byte and
publishes tensors as they land either way); they differ in cost, and the cost depends on the pages under the
segment's volume (:mod:`modelload.loader.segment.pages`):

- **through the descriptor** (``os.splice`` from the socket or the file into the segment's file): the kernel
  fills the file's pages itself, with no page faults in the sidecar. The cheaper path on 4 KiB pages (an
  ``emptyDir`` with ``medium: Memory``), where faulting a mapping in costs more than the copy.
- **through the mapping** (``recv_into``/``readinto`` a slice of the mapped segment; ``preadv`` for files):
  one copy into pages that come 2 MiB at a time. The cheaper path on huge pages (a tmpfs mounted
  ``huge=always``/``within_size``), and the only one hugetlbfs takes (its files refuse ``write`` and
  ``splice``).

``auto`` (the default) picks by the volume, as ``benchmarks/landing.py`` measured (figures in
:mod:`~modelload.loader.segment.pages`); ``splice`` and ``mapping`` force a path, to compare them. A source
that cannot splice (HTTPS: its bytes are decrypted in user space) always lands through the mapping. Through
the descriptor, a chunk of many small tensors (its pieces average under ``readers.SPLICE_PIECE``: two
splices per tensor would cost more) goes through a reused buffer and one ``pwritev`` a window
(:mod:`~modelload.sidecar.load.scatter`), except in a ring, whose bytes wrap: it takes the mapping's
scattering reads.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, get_args

from modelload.loader.errors import ConfigError
from modelload.loader.segment.pages import SMALL_PAGE, Volume, prefers_mapping, volume_of
from modelload.sidecar.sources import Source

__all__ = ["LANDINGS", "Landing", "LandingChoice", "choose_landing"]

log = logging.getLogger(__name__)

Landing = Literal["auto", "splice", "mapping"]
LANDINGS: tuple[str, ...] = get_args(Landing)


@dataclass(frozen=True)
class LandingChoice:
    """The volume under the segment and the path chosen for it."""

    volume: Volume
    through_fd: bool

    @property
    def page_size(self) -> int:
        """The page size to plan the segment for."""
        return self.volume.page_size

    def describe(self) -> str:
        path = "splice through the file descriptor" if self.through_fd else "the segment's mapping"
        return f"{path}, on {self.volume.describe()}"


def choose_landing(landing: Landing, segment: Path, sources: Sequence[Source]) -> LandingChoice:
    """The path the bytes of a load into ``segment`` take, from the ``landing`` setting, the segment's volume
    and what ``sources`` support. Raises :class:`ConfigError` for ``splice`` onto hugetlbfs."""
    if landing not in LANDINGS:
        raise ConfigError(f"landing must be one of {', '.join(LANDINGS)}, got {landing!r}")
    volume = _volume(segment.parent)
    if volume.mapping_only and landing == "splice":
        raise ConfigError(
            f"--landing splice cannot write {segment.parent}: it is hugetlbfs, whose files take bytes only "
            "through a mapping; use --landing auto or mapping"
        )
    can_splice = all(source.supports_fd for source in sources)
    if landing == "auto":
        through_fd = can_splice and not prefers_mapping(volume)
    else:
        through_fd = landing == "splice" and can_splice
    choice = LandingChoice(volume, through_fd)
    log.info("landing through %s", choice.describe())
    return choice


def _volume(directory: Path) -> Volume:
    """The segment folder's volume; 4 KiB pages where it does not exist yet (the writer then says so)."""
    try:
        return volume_of(directory)
    except OSError:
        return Volume("small", SMALL_PAGE)
