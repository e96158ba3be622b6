"""Host memory that follows the consumer: memory modes ``full``, ``release`` and ``ring``.

``manager`` (:class:`MemoryManager`) releases tensors once every consumer copied them and admits chunks into
the ring; ``ring`` (:class:`RingSpace`) keeps the ring's taken intervals; ``settings`` holds
:class:`MemorySettings`, the mode and its bounds.
"""

from modelload.sidecar.memory.manager import MemoryManager, plan_memory
from modelload.sidecar.memory.ring import RingSpace
from modelload.sidecar.memory.settings import MemorySettings, Mode

__all__ = ["MemoryManager", "MemorySettings", "Mode", "RingSpace", "plan_memory"]
