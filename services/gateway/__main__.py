from services.gateway.app import main, parser
from shared import service

if __name__ == "__main__":
    service.run("gateway", main, parser().parse_args())
