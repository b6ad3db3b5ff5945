from services.prefill.app import main
from shared import service

if __name__ == "__main__":
    service.run("prefill", main, service.parser("prefill", instance=True).parse_args())
