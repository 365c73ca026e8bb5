"""The type of what readers and writers of files take: a binary file, or one of ckptctl's
file-like views of one (``io.RawIOBase`` subclasses: the hashing writer a job writes through,
the offset writer and the record window of DCP records)."""

from __future__ import annotations

import io
from typing import BinaryIO, TypeAlias

ByteStream: TypeAlias = BinaryIO | io.RawIOBase
