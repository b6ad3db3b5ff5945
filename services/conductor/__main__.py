from services.conductor.app import main, parser
from shared import service

if __name__ == "__main__":
    service.run("conductor", main, parser().parse_args())
