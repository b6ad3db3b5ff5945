from services.conductor.app import main
from shared import service

if __name__ == "__main__":
    service.run("conductor", main, service.parser("conductor", instance=False).parse_args())
