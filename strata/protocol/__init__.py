"""What the coordinator and the stages share: one dataclass per message with its encoding,
tensor frames, the sockets and their keys, and the acceptance rule of draft tokens.
May import: config_error"""
