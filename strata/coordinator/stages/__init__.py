"""The link to the stage processes: the pipeline (sockets, handshake, windows out, results in)
and the stages' liveness (heartbeats, dead or hung). Mechanism only: it knows no policy.
May import: coordinator, protocol, trace, config_error"""
