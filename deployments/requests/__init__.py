"""What the server reads off the wire, whichever door it came through: the per-row options (`rows.RowOptions`, built
once by a door's decoder and carried unchanged to the model batch), the typed request every door hands the graph
runner (`generations.GenerationRequest`), each door's decoder (`generations` for HTTP, `openpi` for the WebSocket,
`rldx` for ZeroMQ), the HTTP reply builder (`replies`), the OpenPI frames the door sends (`openpi`) and the decode
limits sized from a door's bounds with the decode worker pool (`limits`). Server-side only: the robot's client
package keeps the body builders, the reply readers and the constants it sends (`dreamzero_client.wire`).
"""
