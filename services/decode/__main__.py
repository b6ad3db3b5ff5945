from services.decode.app import main
from shared import service

if __name__ == "__main__":
    service.run("decode", main, service.parser("decode", instance=True).parse_args())
