from services.prefill.app import main, parser
from shared import service

if __name__ == "__main__":
    service.run("prefill", main, parser().parse_args())
