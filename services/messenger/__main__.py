from services.messenger.app import main, parser
from shared import service

if __name__ == "__main__":
    service.run("messenger", main, parser().parse_args())
