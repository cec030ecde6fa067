"""The routes of the server (HTTP and WebSocket paths), shared by the server and the clients."""

GENERATIONS_PATH = "/v1/actions/generations"
METADATA_PATH = "/v1/actions/metadata"
MODELS_PATH = "/v1/models"
HEALTH_PATH = "/health"
OPENPI_WS_PATH = "/v1/realtime/robot/openpi"
