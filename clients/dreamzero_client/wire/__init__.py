"""The wire protocol shared by the server and the clients: numpy and msgpack only.

`codec` (bytes <-> objects), `fields` (field readers), `generations` (generations requests), `replies` (replies,
session reports, error bodies), `openpi` (WebSocket frames), `routes` (paths).
"""
