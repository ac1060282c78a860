"""What the coordinator and the stages share: one dataclass per message with its encoding,
tensor frames, the sockets and their keys, and the acceptance rule of draft tokens. rows.py, a
window's rows as records, states its own rule (it imports nothing, so the kernels may import it).
May import: protocol.rows, config_error"""
