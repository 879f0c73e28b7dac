"""One-sided writes into the receiver's pool, for peers on one host (`backend="shm"|"auto"`).

    sender                                             receiver (pools in shared memory)
    header (mode "shm") ────────────────────────────>  admit; reserve pages (device or host tier)
                        <── Grant(pool locator, pages, write slot s, generation g, credit)
    map the pool once; per piece (a quarter of what is left, 1 to 4 chunk_bytes):
      hold slot s at g (shm_slots.py); copy rows straight into the pages; let go
    Commit(checksum) ───────────────────────────────>  revoke s; read the pages back and check
                        <── Ack                         the sum; commit

Control messages start on the ZeroMQ socket of the zmq backend. Every Grant also names the
receiver's local link (local_link.py) and a ticket for the peer it goes to; the sender connects
(again after a lost link or a reset), and once no transfer announced on ZeroMQ is left it
announces on the link (a Unix socket the event loop reads: one wake-up per message where
ZeroMQ's I/O threads take several). A transfer's own messages all go the way its header went;
the receiver answers a linked peer there and pumps ZeroMQ into the same queue, and the sender
checks ZeroMQ at every link message and tick. The payload
bytes move in one copy, from the sender's export into the receiver's pool pages, with no
socket, no receive buffer and no landing copy. The state machines, timeouts, Nacks and page
ownership are the zmq backend's; a link that ends fails the sender's transfers in flight
(PEER_LOST; those announced on ZeroMQ too), as a reset ZeroMQ connection does, once every
message that came on it before the end has been read.

- A receiver whose receiving pool is not shared (PagePool(shared=True)) answers a Credit, and
  the sender streams chunks as in the zmq backend.
- A GPU pool is shared through a CUDA IPC handle (pdtb/engine/cuda_ipc.py): a sender whose
  payload is on a GPU copies device to device, and synchronizes before it lets go of the
  slot; the receiver reads the pages back on the device.
- A sender that cannot map the Grant's pool (another host, another container's /proc) streams
  chunks under the Grant's credit with `backend="auto"`; with `backend="shm"` the transfer
  fails (code peer_lost) with the reason.
- A late writer never touches pages handed out again: every grant has a fresh generation, a
  sender writes a piece only while it holds the slot's lock and reads its generation there, and
  the receiver frees or commits the pages only after it has revoked the slot under that lock.
  A sender inside a piece when its transfer fails (stalled, or slow) keeps the revoke from
  succeeding: the pages stay reserved, the Nack goes out, and the revoke is tried again every
  tick; a sender that dies drops its lock with its files.
"""
from __future__ import annotations

from kv_transport.page_writer import PageWriter  # noqa: F401 (tests patch the writer's class)
from kv_transport.shm_common import piece_rows  # noqa: F401
from kv_transport.shm_receiver import ShmReceiver
from kv_transport.shm_sender import ShmSender

__all__ = ["ShmSender", "ShmReceiver"]
