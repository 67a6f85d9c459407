"""The block-table changes of one step, as the scheduler hands them to the runner(s).

The manager owns the block tables; a runner keeps its own copy of the rows it reads
(``kvledger.worker.block_table.BlockTable``) and updates it from these deltas only, so no runner
(in this process or in a tensor-parallel worker) ever reads the manager's state. vLLM v1 sends
``new_block_ids`` the same way; here one shape covers every change: appends, a copy-on-write
replacement, swap-out (-1) and swap-in, window releases (RELEASED) and trims all say "entries
from ``start`` on are now these". Plain tuples and lists only, so a delta crosses a process
boundary as it is.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class TableDelta:
    """Entries ``[start:]`` of ``request_id``'s block table are now ``block_ids`` (the table
    ends there). ``group``: the layer group whose table this is (0 while there is one)."""

    request_id: str
    start: int
    block_ids: list[int]
    group: int = 0


@dataclass(slots=True)
class TableDeltas:
    """Everything a runner's block table must apply before the step runs: the tables of
    ``removed`` requests are dropped first (a request freed and re-admitted within one step's
    window is dropped, then rebuilt from ``start`` 0), then ``changed`` are applied in order."""

    removed: list[str] = field(default_factory=list)
    changed: list[TableDelta] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.removed or self.changed)
