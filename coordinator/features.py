"""The target's hidden features on their way to an EAGLE-style draft (issue 68): the verify
returns those of every position it ran (VerifyResponse.features); the coordinator keeps those
of the tokens the round committed, all but the last (whose features come with the next
verify), and sends them with the draft's next Propose (ProposeRequest.features). They stay
bytes here: the coordinator slices rows, it never reads a value."""

from __future__ import annotations

from dataclasses import dataclass

from specdec.rpc.wire import FEATURE_ITEM_BYTES
from specdec.v1 import common_pb2


@dataclass(frozen=True)
class FeatureRows:
    """Rows of consecutive positions start .. start + rows - 1, `width` values each."""

    start: int
    rows: int
    width: int
    dtype: str
    data: bytes

    @classmethod
    def committed(cls, features: common_pb2.Features, end: int) -> FeatureRows | None:
        """A verify's features of positions before `end` (the committed sequence's last
        position: its token has none yet); None when there are none."""
        rows = min(features.rows, end - features.start)
        if rows <= 0:
            return None
        return cls(
            features.start, rows, features.width, features.dtype, features.data[: rows * cls._row_bytes(features)]
        )

    @staticmethod
    def _row_bytes(features) -> int:
        return features.width * FEATURE_ITEM_BYTES.get(features.dtype, 0)

    @property
    def end(self) -> int:
        return self.start + self.rows

    def then(self, later: FeatureRows) -> FeatureRows:
        """These rows followed by `later`'s, which win where both have a position. After a gap
        (a round whose features were lost) only `later`'s: one message holds consecutive rows,
        and the draft reads positions nobody sent as zeros (exact, only less often accepted)."""
        if (
            later.start > self.end
            or later.start <= self.start
            or (later.width, later.dtype) != (self.width, self.dtype)
        ):
            return later
        kept = later.start - self.start
        return FeatureRows(
            self.start,
            kept + later.rows,
            self.width,
            self.dtype,
            self.data[: kept * self._row_bytes(self)] + later.data,
        )

    def after(self, end: int) -> FeatureRows | None:
        """The rows of positions from `end` on (those before it were delivered); None if none."""
        if end <= self.start:
            return self
        if end >= self.end:
            return None
        dropped = end - self.start
        return FeatureRows(
            end, self.rows - dropped, self.width, self.dtype, self.data[dropped * self._row_bytes(self) :]
        )

    def message(self) -> common_pb2.Features:
        return common_pb2.Features(start=self.start, rows=self.rows, width=self.width, dtype=self.dtype, data=self.data)
