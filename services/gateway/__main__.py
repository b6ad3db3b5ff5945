import os

from services.gateway.app import main
from shared import service

if __name__ == "__main__":
    p = service.parser("gateway", instance=False)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=os.environ.get("YUEBING_API_KEY"), help="require this Bearer key (default: $YUEBING_API_KEY)")
    service.run("gateway", main, p.parse_args())
