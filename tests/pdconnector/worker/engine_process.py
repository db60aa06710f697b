"""An engine process for the cross-process tests: hosts :class:`Engine` s by name and answers JSON-line calls
on stdin."""

from __future__ import annotations

import json
import os
import sys
import traceback
from typing import Any

from pdconnector.transport.nixl_transport import NixlTransport

from tests.pdconnector.worker.engines import Engine, EngineHost


def main() -> None:
    engines: dict[str, Engine] = {}
    for line in sys.stdin:
        call = json.loads(line)
        name, method, kwargs = call["engine"], call["method"], call["kwargs"]
        try:
            result: Any = None
            if method == "init":
                engines[kwargs["name"]] = Engine(**kwargs)
            elif method == "warm_nixl":
                NixlTransport(f"warm-{os.getpid()}").close()
            elif method == "exit":
                for engine in engines.values():
                    engine.close()
            else:
                result = getattr(engines[name], method)(**kwargs)
                if method == "close":
                    del engines[name]
            reply = {"result": result}
        except Exception as error:
            reply = {"error": f"{type(error).__name__}: {error}\n{traceback.format_exc()}"}
        sys.stdout.write(EngineHost.PREFIX + json.dumps(reply) + "\n")
        sys.stdout.flush()
        if method == "exit":
            return


if __name__ == "__main__":
    main()
