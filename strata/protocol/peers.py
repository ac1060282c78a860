"""Whether the process at the other end of a PUSH socket has gone: a stage watches its socket to
the coordinator's inbox, and exits once the coordinator has died (however it died: the kernel
closes a dead process's sockets), instead of holding its memory for ever. A coordinator that is
only stopped (a debugger, SIGSTOP) keeps its sockets open: its stages wait for it.

    watch = PeerWatch(to_coordinator)
    if watch.gone(): ...      # cheap: call it whenever the stage has waited a while
    watch.close()             # before the socket's context ends

Over Unix sockets the connection itself says so (unixsock.UnixPush.peer_gone); over ZeroMQ a
socket monitor reports the disconnection (ZeroMQ reconnects by itself: a peer that binds the
endpoint again counts as back). A peer that refused this side's CurveZMQ key (keys.py) closes
the connection too: `refused` then says so, so that the stage can say which key to give it.
"""
from __future__ import annotations

from strata.protocol import unixsock


class PeerWatch:
    def __init__(self, sock):
        self.sock, self.monitor, self.down, self.refused = sock, None, False, False
        if not isinstance(sock, unixsock.UnixPush):
            import zmq
            self.monitor = sock.get_monitor_socket(
                zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED | zmq.EVENT_HANDSHAKE_FAILED_AUTH
                | zmq.EVENT_HANDSHAKE_SUCCEEDED)

    def gone(self) -> bool:
        if self.monitor is None:
            return self.sock.peer_gone()
        import zmq
        from zmq.utils.monitor import recv_monitor_message
        while self.monitor.poll(0):
            event = recv_monitor_message(self.monitor)["event"]
            if event == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
                self.refused = True
            elif event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self.refused = False
            elif event in (zmq.EVENT_CONNECTED, zmq.EVENT_DISCONNECTED):
                self.down = event == zmq.EVENT_DISCONNECTED
        return self.down

    def close(self) -> None:
        if self.monitor is not None:
            self.sock.disable_monitor()
            self.monitor.close(linger=0)
            self.monitor = None
