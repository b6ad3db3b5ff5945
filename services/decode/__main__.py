from services.decode.app import main, parser
from shared import service

if __name__ == "__main__":
    service.run("decode", main, parser().parse_args())
