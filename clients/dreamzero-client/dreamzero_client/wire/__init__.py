"""The wire protocol shared by the server and the clients: numpy and msgpack only.

`codec` (bytes <-> objects), `limits` (decode bounds), `generations` (the body builder and its constants), `replies`
(the reply reader, restart reasons, error bodies), `openpi` (WebSocket frames), `rldx` (the ZeroMQ codec), `routes`
(paths). What only the server runs (parsers, reply and frame builders, decode sizing) is in `deployments.requests`.
"""
