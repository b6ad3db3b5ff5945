from services.nats_auth.app import main, parser
from shared import service

if __name__ == "__main__":
    service.run("nats_auth", main, parser().parse_args())
