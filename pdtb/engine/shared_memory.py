"""Memory another process on this host can map: a memfd segment with a small header.

A KV pool that a one-sided sender writes into (kv_transport/shm_backend.py) lives in one of
these. The segment is an anonymous memfd (`os.memfd_create`), so it has no name in a file
system to leak: it goes away with the last process that maps it, a receiver killed with
`kill -9` included. A peer opens it through `/proc/<pid>/fd/<fd>` (`SharedBuffer.locator`),
which names a new open file description of the same memory.

Layout: one 4 KiB header page, then the data.

    offset 0   magic  b"PDTBSHM1"
    offset 8   token  16 random bytes: a peer checks it, so a reused pid/fd pair or another
                      host's /proc never passes for this buffer
    offset 24  nbytes of data (uint64, little endian)
    offset 4096 data

`boot_id()` names this boot of this host: a peer whose boot id differs cannot share memory
with us and does not try.
"""
from __future__ import annotations

import fcntl
import functools
import mmap
import os
import secrets
import stat
from dataclasses import dataclass

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # (imported where storage is made or moved: a pool without storage needs no torch)
    import torch

MAGIC = b"PDTBSHM1"
HEADER_BYTES = 4096
TOKEN_BYTES = 16


class SharedMemoryError(OSError):
    """The buffer cannot be created or mapped (no memfd, another host, a stale locator)."""


@functools.cache
def boot_id() -> str:
    """This boot of this host (Linux's random boot id; the host name elsewhere)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return os.uname().nodename


@dataclass(frozen=True)
class Locator:
    """How a peer on this host finds a buffer (travels in msgpack as three strings)."""

    path: str  # /proc/<pid>/fd/<fd> of the owner
    token: str  # hex of the header's token
    host: str  # boot_id() of the owner's host


class SharedBuffer:
    """`nbytes` of zeroed memory in a memfd, mapped read-write, with a peer-visible locator."""

    def __init__(self, nbytes: int, name: str = "pdtb-kv") -> None:
        if not hasattr(os, "memfd_create"):
            raise SharedMemoryError("os.memfd_create is not available on this platform")
        self.nbytes = nbytes
        self.fd = os.memfd_create(name, os.MFD_CLOEXEC | getattr(os, "MFD_ALLOW_SEALING", 0))
        try:
            os.ftruncate(self.fd, HEADER_BYTES + nbytes)  # zero-filled, faulted in on first touch
            if hasattr(fcntl, "F_ADD_SEALS"):  # its size is fixed: no peer can shrink it under another's mapping (SIGBUS)
                fcntl.fcntl(self.fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW)
            self.map = mmap.mmap(self.fd, HEADER_BYTES + nbytes)
        except OSError:
            os.close(self.fd)
            raise
        token = secrets.token_bytes(TOKEN_BYTES)
        self.map[:8] = MAGIC
        self.map[8:24] = token
        self.map[24:32] = nbytes.to_bytes(8, "little")
        self.locator = Locator(f"/proc/{os.getpid()}/fd/{self.fd}", token.hex(), boot_id())

    def tensor(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """The data area as a tensor of `shape` (it must fit exactly)."""
        return data_tensor(self.map, self.nbytes, shape, dtype)

    def close(self) -> None:
        """Drop this process's fd (the mapping lives as long as tensors over it)."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def data_tensor(mm: mmap.mmap, nbytes: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    import torch
    t = torch.frombuffer(mm, dtype=torch.uint8, count=nbytes, offset=HEADER_BYTES)
    return t.view(dtype).view(shape)


@dataclass
class Mapped:
    """A peer's mapping of a SharedBuffer."""

    locator: Locator
    map: mmap.mmap
    nbytes: int  # data bytes
    fd: int  # this process's open file description of the buffer (its locks are its own)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def open_buffer(loc: Locator, writable: bool = True) -> Mapped:
    """Map a buffer another process of this host shares (read-only unless `writable`);
    SharedMemoryError if it is not there, not ours (token), or on another host."""
    if loc.host != boot_id():
        raise SharedMemoryError(f"the buffer is on another host (boot id {loc.host[:8]}...)")
    if not loc.path.startswith("/proc/"):
        raise SharedMemoryError(f"not a buffer locator: {loc.path!r}")
    try:
        fd = os.open(loc.path, (os.O_RDWR if writable else os.O_RDONLY) | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError as e:
        raise SharedMemoryError(f"cannot open {loc.path}: {e.strerror}") from None
    except ValueError as e:  # (a NUL in the path: it came off the wire)
        raise SharedMemoryError(f"cannot open {loc.path!r}: {e}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size < HEADER_BYTES:
            raise SharedMemoryError(f"{loc.path} is not a shared KV buffer")
        mm = mmap.mmap(fd, st.st_size, prot=mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0))
    except (OSError, ValueError) as e:
        os.close(fd)
        raise SharedMemoryError(f"cannot map {loc.path}: {e}") from None
    nbytes = int.from_bytes(mm[24:32], "little")
    if mm[:8] != MAGIC or mm[8:24].hex() != loc.token or HEADER_BYTES + nbytes > st.st_size:
        mm.close()
        os.close(fd)
        raise SharedMemoryError(f"{loc.path} is not the buffer the peer named (token mismatch)")
    return Mapped(loc, mm, nbytes, fd)
