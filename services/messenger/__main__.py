from services.messenger.app import main
from shared import service

if __name__ == "__main__":
    service.run("messenger", main, service.parser("messenger", instance=True).parse_args())
