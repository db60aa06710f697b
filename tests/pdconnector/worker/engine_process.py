"""An engine process for the cross-process tests: hosts one :class:`Engine` and answers JSON-line calls on stdin."""

from __future__ import annotations

import json
import sys
import traceback

from tests.pdconnector.worker.engines import Engine, EngineProcess


def main() -> None:
    engine: Engine | None = None
    for line in sys.stdin:
        call = json.loads(line)
        method, kwargs = call["method"], call["kwargs"]
        try:
            if method == "init":
                engine = Engine(**kwargs)
                result = None
            else:
                assert engine is not None, "init first"
                result = getattr(engine, method)(**kwargs)
            reply = {"result": result}
        except Exception as error:
            reply = {"error": f"{type(error).__name__}: {error}\n{traceback.format_exc()}"}
        sys.stdout.write(EngineProcess.PREFIX + json.dumps(reply) + "\n")
        sys.stdout.flush()
        if method == "close":
            return


if __name__ == "__main__":
    main()
